"""overlap_forward=True on model code nobody here wrote: Hugging Face GPT-2
(also with gradient checkpointing), Llama and BERT, timm's ViT (also with
checkpoint_seq and drop path), ConvNeXt and ResNet, each trained a few steps
with an EMA (AveragedModel) updated right after every step().

Each run with overlap, with random copy delays that make the updates lag, is
compared bitwise (torch.equal) with the same loop without overlap: losses,
params, and the EMA's params. In the slow tier (transformers and timm are not
among the suite's requirements; .ci/run installs them for this tier).
"""

import gc

import pytest
import torch

import swap_optimizer as so

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers", reason="pip install transformers (the slow tier's extras)")
timm = pytest.importorskip("timm", reason="pip install timm (the slow tier's extras)")


def train(build, batch, loss_of, overlap, steps=5, without_waits=False):
    torch.manual_seed(0)
    model = build()
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), swap_times=8,
                                 num_arenas=3, min_numel=0, **extra)
    if overlap:
        optimizer._set_test_hooks(copy_delay_us=4000 if without_waits else 1000, seed=3)
    if without_waits:  # the negative control: every wait of the forward and outside it off
        optimizer._overlap.set_test_hooks(knocked_out=range(len(list(model.parameters()))),
                                          unguarded={"ops", "divergence", "compiled"})
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    logged = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_of(model, batch(step))
        loss.backward()
        logged.append(loss.detach())
        optimizer.step()
        ema.update_parameters(model)
    optimizer.wait()
    if overlap:
        assert optimizer._overlap.schedule is not None, "the probe never ran"
    return logged + [p.detach().clone() for p in (*model.parameters(), *ema.parameters())]


def tokens(step):
    return torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(step))


def images(step):
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(step))


def language_model_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def image_loss(model, x):
    return model(x).square().mean()


def gpt2(checkpointing=False):
    def build():
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=3, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0))
        if checkpointing:
            model.gradient_checkpointing_enable()
        return model
    return build


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=1000,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def vit(checkpointing=False, drop_path=0.0):
    def build():
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                                  num_classes=10, drop_path_rate=drop_path)
        model.set_grad_checkpointing(checkpointing)  # timm's checkpoint_seq over the blocks' nn.Sequential
        return model
    return build


def timm_model(name):
    return lambda: timm.create_model(name, pretrained=False, num_classes=10)


CASES = {
    "hf_gpt2": (gpt2(), tokens, language_model_loss),
    "hf_gpt2_gradient_checkpointing": (gpt2(checkpointing=True), tokens, language_model_loss),
    "hf_llama": (llama, tokens, language_model_loss),
    "hf_bert": (bert, tokens, language_model_loss),
    "timm_vit": (vit(), images, image_loss),
    "timm_vit_checkpoint_seq": (vit(checkpointing=True), images, image_loss),
    "timm_vit_drop_path": (vit(drop_path=0.3), images, image_loss),
    "timm_convnext": (timm_model("convnext_atto"), images, image_loss),
    "timm_resnet": (timm_model("resnet18"), images, image_loss),
}


@pytest.mark.parametrize("case", CASES)
def test_overlap_is_bitwise_on_real_models(case):
    build, batch, loss_of = CASES[case]
    plain, overlapped = (train(build, batch, loss_of, overlap) for overlap in (False, True))
    assert len(plain) == len(overlapped)
    for i, (a, b) in enumerate(zip(plain, overlapped)):
        assert torch.equal(a, b), f"{case}: logged value or param {i} differs"
    gc.collect()
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("case", ["hf_gpt2", "timm_vit_checkpoint_seq"])
def test_the_comparison_sees_reads_that_do_not_wait(case):
    """Negative control: with every wait switched off, the same comparison
    fails on these models (the copy delays really make the updates lag)."""
    build, batch, loss_of = CASES[case]
    plain = train(build, batch, loss_of, False)
    unwaited = train(build, batch, loss_of, True, without_waits=True)
    assert any(not torch.equal(a, b) for a, b in zip(plain, unwaited))
