"""python -m swap_optimizer.plan: its figures are those of a real step (memory_stats()
of SwapOptimizer on CPU params of the planned shapes, in every state mode, and the
device budget's choice), hand arithmetic on configs and presets, refusals, and
FSDP2 sharding. The large presets are planned on meta tensors only."""

import json

import pytest
import torch

from swap_optimizer import StepCostModel, SwapOptimizer, plan
from swap_optimizer.budget import allocated
from swap_optimizer.presets import PRESETS, from_hf_config
from swap_optimizer.rules import REFUSED

GIB = 1 << 30
TINY_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def write_config(tmp_path, **config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def run_plan(tmp_path, *args):
    out = tmp_path / "plan.json"
    assert plan.main([*map(str, args), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    return report, {row["plan"]: row for row in report["rows"]}


def printed(capsys):
    """What the planner printed, its lines joined (they are wrapped at 118 columns)."""
    return " ".join(line.strip() for line in capsys.readouterr().out.splitlines())


def stepped(shapes, **settings):
    """SwapOptimizer over bf16 CPU params of `shapes` after one step with random grads."""
    torch.manual_seed(0)
    params = [torch.randn(shape, dtype=torch.bfloat16).requires_grad_() for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = SwapOptimizer(torch.optim.AdamW(params), min_numel=1024, **settings)
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("swap_times, num_arenas", [(4, 2), (3, 3)])
def test_rows_equal_memory_stats_of_a_real_step(tmp_path, swap_times, num_arenas):
    config = write_config(tmp_path, **TINY_LLAMA)
    _, rows = run_plan(tmp_path, "--config", config, "--device-memory", 1, "--swap-times", swap_times,
                       "--num-arenas", num_arenas)
    shapes = from_hf_config(config).param_shapes()
    assert set(rows) == {"resident AdamW", "swapped", "swapped bf16", "swapped 8bit", "swapped master",
                         "swapped kahan", "swapped kahan+8bit", "best resident share"}
    for mode, settings in plan.STATE_MODES.items():
        row = rows["swapped" + ("" if mode == "default" else f" {mode}")]
        stats = stepped(shapes, swap_times=swap_times, num_arenas=num_arenas, **settings).memory_stats()
        assert (row["host_state_bytes"], row["resident_state_bytes"], row["staging_bytes"], row["batches"]) == \
            (stats["host_state_bytes"], stats["resident_state_bytes"], stats["peak_staging_bytes"],
             stats["batches"]), mode
        assert row["moved_bytes_each_way"] == stats["h2d_bytes"] == stats["d2h_bytes"], mode
        assert (row["swap_times"], row["num_arenas"]) == (swap_times, num_arenas)


def test_torch_row_equals_a_plain_adamw_step(tmp_path):
    config = write_config(tmp_path, **TINY_LLAMA)
    _, rows = run_plan(tmp_path, "--config", config, "--device-memory", 1)
    params = [torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
              for shape in from_hf_config(config).param_shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    state = sum(allocated(value.nbytes) for entry in optimizer.state.values() for value in entry.values()
                if value.dim() > 0)
    assert rows["resident AdamW"]["resident_state_bytes"] == state
    assert rows["resident AdamW"]["host_state_bytes"] == rows["resident AdamW"]["moved_bytes_each_way"] == 0


def test_best_resident_share_is_what_the_device_budget_chooses(tmp_path):
    """The budget row is SwapOptimizer(device_budget_bytes=the optimizer budget)'s plan under the same cost model."""
    config = write_config(tmp_path, **TINY_LLAMA)
    shapes = from_hf_config(config).param_shapes()
    params_and_grads = 2 * 2 * sum(torch.Size(s).numel() for s in shapes)
    device = (params_and_grads + 400_000) / GIB  # room for part of the 0.56 MB of state
    # A slow link, so that bytes moved outweigh a batch's fixed cost even for so small a model.
    report, rows = run_plan(tmp_path, "--config", config, "--device-memory", f"{device:.12f}", "--headroom-gib", 0,
                            "--activation-gib", 0, "--link-gbps", 1)
    best = rows["best resident share"]
    budget = report["optimizer_budget_bytes"]
    assert 0 < budget < rows["swapped"]["host_state_bytes"] and best["fits_device"]
    assert 0 < best["resident_share"] < 1 and best["resident_params"] > 0
    stats = stepped(shapes, device_budget_bytes=budget, cost_model=StepCostModel(**report["cost_model"])).memory_stats()
    assert (best["swap_times"], best["num_arenas"]) == (stats["plan"]["swap_times"], stats["plan"]["num_arenas"])
    assert (best["host_state_bytes"], best["resident_state_bytes"], best["staging_bytes"]) == \
        (stats["host_state_bytes"], stats["resident_state_bytes"], stats["peak_staging_bytes"])
    assert best["optimizer_device_bytes"] == stats["plan"]["device_bytes"]["total"] <= budget


def test_hand_arithmetic_on_a_made_up_config(tmp_path):
    """Every tensor has at least min_numel elements, so every state is in host memory."""
    vocab, hidden, inner, kv = 1000, 1024, 1536, 2 * 128
    config = write_config(tmp_path, model_type="llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                          intermediate_size=inner, num_attention_heads=8, num_key_value_heads=2)
    numel = 2 * vocab * hidden + (2 * hidden * hidden + 2 * kv * hidden + 3 * inner * hidden + 2 * hidden) + hidden
    report, rows = run_plan(tmp_path, "--config", config, "--device-memory", 24)
    assert report["params"] == numel
    tensors = 2 + 9 + 1
    for row in rows.values():
        assert row["params_bytes"] == row["grads_bytes"] == numel * 2
    assert rows["resident AdamW"]["resident_state_bytes"] == pytest.approx(numel * 4, abs=512 * tensors)
    # fp32 master and fp32 moments: 12 bytes a param, 256-byte aligned per state, and the step table.
    master = rows["swapped master"]
    assert numel * 12 <= master["host_state_bytes"] <= numel * 12 + 3 * 256 * tensors + 4 * tensors + 256
    assert master["resident_state_bytes"] == 0
    assert numel * 4 <= rows["swapped"]["host_state_bytes"] <= numel * 4 + 2 * 256 * tensors + 4 * tensors + 256


def test_biases_and_tied_heads_of_hf_configs(tmp_path):
    h, heads, kv, inner, vocab = 128, 4, 2 * 32, 256, 300
    common = dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=2, intermediate_size=inner,
                  num_attention_heads=heads, num_key_value_heads=2)
    layer = 2 * h * h + 2 * kv * h + 3 * inner * h + 2 * h
    qwen = from_hf_config(write_config(tmp_path, model_type="qwen2", tie_word_embeddings=True, **common))
    assert qwen.numel() == vocab * h + 2 * (layer + h + 2 * kv) + h  # q, k, v biases; one embedding
    llama = from_hf_config(write_config(tmp_path, model_type="llama", attention_bias=True, mlp_bias=True, **common))
    assert llama.numel() == 2 * vocab * h + 2 * (layer + 2 * h + 2 * kv + 2 * inner + h) + h
    write_config(tmp_path, model_type="mistral", **common)
    mistral = from_hf_config(str(tmp_path))  # the folder holding config.json
    assert mistral.numel() == 2 * vocab * h + 2 * layer + h
    gpt2 = from_hf_config(write_config(tmp_path, model_type="gpt2", vocab_size=vocab, n_positions=64, n_embd=h,
                                       n_layer=2, n_head=heads))
    assert gpt2.numel() == (vocab + 64) * h + 2 * (12 * h * h + 13 * h) + 2 * h


def test_presets_have_the_published_param_counts():
    counts = {"gpt2-124m": 124_439_808, "qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400,
              "llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_241_732_096}
    assert {name: shape.numel() for name, (_, shape) in PRESETS.items()} == counts
    # Llama-3.1-8B's lm_head is its own tensor; Llama-3.2-1B's is the embedding.
    assert PRESETS["llama-3.1-8b"][1].param_shapes().count((128256, 4096)) == 2
    assert PRESETS["llama-3.2-1b"][1].param_shapes().count((128256, 2048)) == 1


def test_llama_8b_does_not_fit_24_gib_and_needs_96_gb_pinned_for_masters(tmp_path, capsys):
    params = 8_030_261_248
    _, rows = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 24)
    assert round((rows["swapped"]["params_bytes"] + rows["swapped"]["grads_bytes"]) / GIB, 1) == 29.9
    assert rows["swapped"]["params_bytes"] == params * 2
    assert not any(row["fits_device"] for row in rows.values())
    assert rows["best resident share"]["optimizer_device_bytes"] is None
    assert rows["swapped master"]["host_state_bytes"] == pytest.approx(params * 12, rel=1e-6)  # 96.4 GB
    assert rows["swapped 8bit"]["moved_bytes_each_way"] / params == pytest.approx(2.03, abs=0.005)
    out = printed(capsys)
    assert "No plan fits 24.00 GiB (no room for the optimizer" in out and "estimate" in out


def test_world_size_halves_the_bytes_per_rank(tmp_path):
    one, rows_one = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 24)
    two, rows_two = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 24, "--world-size", 2)
    assert two["rank_params"] * 2 == one["rank_params"] == one["params"] == two["params"]
    for name in ("swapped", "swapped master", "swapped 8bit"):
        assert rows_two[name]["params_bytes"] * 2 == rows_one[name]["params_bytes"]
        assert rows_two[name]["host_state_bytes"] * 2 == pytest.approx(rows_one[name]["host_state_bytes"], rel=1e-4)
        assert rows_two[name]["moved_bytes_each_way"] * 2 == pytest.approx(rows_one[name]["moved_bytes_each_way"],
                                                                           rel=1e-4)


def test_uneven_shards_take_ceil_rows(tmp_path):
    config = write_config(tmp_path, **dict(TINY_LLAMA, vocab_size=513))
    report, _ = run_plan(tmp_path, "--config", config, "--device-memory", 1, "--world-size", 2)
    shapes = from_hf_config(config).param_shapes()
    assert report["rank_params"] == sum(-(-s[0] // 2) * torch.Size(s[1:]).numel() for s in shapes)


def test_fp32_params_have_no_master_or_kahan_rows(tmp_path):
    _, rows = run_plan(tmp_path, "gpt2-124m", "--device-memory", 16, "--dtype", "fp32")
    assert set(rows) == {"resident AdamW", "swapped", "swapped bf16", "swapped 8bit", "best resident share"}
    assert rows["swapped"]["moved_bytes_each_way"] == pytest.approx(124_439_808 * 8, rel=1e-3)


def test_refuses_unknown_model_types_naming_the_supported_ones(tmp_path, capsys):
    config = write_config(tmp_path, **dict(TINY_LLAMA, model_type="mixtral"))
    with pytest.raises(ValueError, match="model_type 'mixtral' is not supported.*llama, qwen2, mistral, gpt2"):
        from_hf_config(config)
    with pytest.raises(SystemExit):
        plan.main(["--config", config, "--device-memory", "24"])
    assert "llama, qwen2, mistral, gpt2" in capsys.readouterr().err
    missing = write_config(tmp_path, **{k: v for k, v in TINY_LLAMA.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="needs 'hidden_size'"):
        from_hf_config(missing)


@pytest.mark.slow  # the budget search over an 8B model's layouts: minutes (docs/usage.md, the planner)
def test_fits_host_leaves_a_reserve_for_the_os(tmp_path, capsys):
    """Pinned pages cannot be swapped out: a plan pinning 28.09 of 28.16 GiB
    of RAM does not fit. The reserve is max(2 GiB, 10% of RAM), or given.
    (AdamW's default states run torch's update, whose foreach temporaries the
    budget counts: its plan keeps less resident than the packed kernel's did.)"""
    report, rows = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 48, "--host-memory", 28.16)
    best = rows["best resident share"]
    assert round(best["host_state_bytes"] / GIB, 2) == 28.09 and best["fits_device"]
    assert best["fits_host"] is False
    assert report["memory"]["host_reserve"] == int(0.1 * int(28.16 * GIB))
    out = printed(capsys)
    assert "less a reserve of 2.82 GiB (max(2 GiB, 10%)" in out
    assert "host: 28.09 GiB pinned, more than 25.34 GiB (28.16 less the 2.82 reserve)" in best["why_not"]
    assert "does not fit: host: 28.09 GiB pinned" in out
    assert rows["swapped 8bit"]["fits_host"] and rows["swapped 8bit"]["why_not"] is None  # 15.19 GiB
    _, rows = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 48, "--host-memory", 28.16,
                       "--host-reserve-gib", 0)
    assert rows["best resident share"]["fits_host"]
    report, rows = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 48, "--host-memory", 17)
    assert report["memory"]["host_reserve"] == 2 * GIB  # 10% of 17 GiB is less than 2 GiB
    assert rows["swapped 8bit"]["fits_host"] is False  # 15.19 GiB pinned, more than 15.00


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_swapped_bf16_equals_swapped_for_16_bit_params_and_says_why(tmp_path, capsys, dtype):
    report, rows = run_plan(tmp_path, "gpt2-124m", "--device-memory", 16, "--dtype", dtype)
    # the same state bytes; the packed kernel's rows also keep its step counts (4 bytes a tensor) with them
    assert rows["swapped bf16"]["state_bytes_per_param"] == rows["swapped"]["state_bytes_per_param"]
    for key in ("host_state_bytes", "moved_bytes_each_way"):
        assert 0 <= rows["swapped bf16"][key] - rows["swapped"][key] <= 4 * 148, key
    note = f"swapped bf16 stores and moves the same bytes as swapped here: the states of {dtype} params are 2 bytes"
    assert note in printed(capsys) and any(note in line for line in report["notes"])
    report, rows = run_plan(tmp_path, "gpt2-124m", "--device-memory", 16, "--dtype", "fp32")
    assert rows["swapped bf16"]["host_state_bytes"] < 0.51 * rows["swapped"]["host_state_bytes"]
    assert "swapped bf16 stores" not in printed(capsys) and not any("swapped bf16" in n for n in report["notes"])


def test_a_row_that_does_not_fit_says_why(tmp_path, capsys):
    # No room at all: params, grads, activations and headroom exceed the device.
    _, rows = run_plan(tmp_path, "llama-3.1-8b", "--device-memory", 24, "--host-memory", 512)
    best = rows["best resident share"]
    assert best["optimizer_device_bytes"] is None and best["fits_host"] is None
    assert best["why_not"].startswith("no room for the optimizer: headroom 1.00 + params 14.96 + grads 14.96 + "
                                      "activations 10.46")
    # torch's update: its foreach temporaries (three batches of param bytes, 4.68 GiB) counted
    assert rows["swapped"]["why_not"] == "device: 48.79 GiB in all, more than 23.00 GiB (24.00 less 1.00 headroom)"
    out = printed(capsys)
    assert "best resident share: no plan does not fit: no room for the optimizer" in out
    # Some room, less than the smallest plan: a budget of about 1,000 bytes.
    config = write_config(tmp_path, **TINY_LLAMA)
    params_and_grads = 2 * 2 * sum(torch.Size(s).numel() for s in from_hf_config(config).param_shapes())
    report, rows = run_plan(tmp_path, "--config", config, "--device-memory", f"{(params_and_grads + 1000) / GIB:.15f}",
                            "--headroom-gib", 0, "--activation-gib", 0)
    budget = report["optimizer_budget_bytes"]
    assert 0 < budget <= 1000
    why = rows["best resident share"]["why_not"]
    assert why.startswith("the smallest plan (all swapped, at the finest split) takes ")
    assert why.endswith(f"bytes on the device, more than the optimizer's budget of {budget:,} bytes")
    assert int(why.split(" takes ")[1].split(" bytes")[0].replace(",", "")) > budget


@pytest.mark.slow  # the budget search over an 8B model's layouts: minutes (docs/usage.md, the planner)
def test_device_memory_is_optional_for_counts_and_bytes(tmp_path, capsys):
    report, rows = run_plan(tmp_path, "llama-3.1-8b", "--host-memory", 128)
    out = printed(capsys)
    assert "best resident share" not in rows and report["optimizer_budget_bytes"] is None
    assert all(row["fits_device"] is None and row["fits_host"] is not None for row in rows.values())
    assert "fits device" not in out and "fits host" in out
    assert "pass --device-memory GIB" in out and "no --device-memory, so no device fit and no budget's plan" in out
    _, with_device = run_plan(tmp_path, "llama-3.1-8b", "--host-memory", 128, "--device-memory", 80)
    for name, row in rows.items():
        for key in ("host_state_bytes", "moved_bytes_each_way", "staging_bytes", "device_total_bytes",
                    "predicted_step_seconds"):
            assert row[key] == with_device[name][key], (name, key)
    assert "pass --device-memory" not in printed(capsys)


def test_resident_adamw_counts_the_state_only_and_says_so(tmp_path, capsys):
    """The note's claim about torch's update: foreach makes one more
    param-sized set at once (exp_avg_sq's square root), fused none."""
    report, rows = run_plan(tmp_path, "gpt2-124m", "--device-memory", 16, "--dtype", "fp32")
    assert rows["resident AdamW"]["optimizer_device_bytes"] == rows["resident AdamW"]["resident_state_bytes"]
    note = "resident AdamW counts its state only, exp_avg and exp_avg_sq (twice the params' bytes)"
    assert note in printed(capsys) and any(note in line for line in report["notes"])

    from torch.utils._python_dispatch import TorchDispatchMode

    class NewForeachTensors(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "_foreach_" in func.__name__ and not func.__name__.split(".")[0].endswith("_"):
                self.elements += sum(t.numel() for t in out)
            return out

    for flags, expected in ((dict(foreach=True), "params"), (dict(fused=True), 0)):
        params = [torch.randn(300, 10, requires_grad=True), torch.randn(1000, requires_grad=True)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, **flags)
        optimizer.step()
        with NewForeachTensors() as mode:
            optimizer.step()
        assert mode.elements == (4000 if expected == "params" else 0), flags


@pytest.mark.parametrize("args, message", [
    (["gpt2-124m", "--optimizer", "lbfgs"], "SwapOptimizer cannot wrap LBFGS: " + REFUSED[torch.optim.LBFGS]),
    (["gpt2-124m", "--optimizer", "sparseadam"],
     "SwapOptimizer cannot wrap SparseAdam: " + REFUSED[torch.optim.SparseAdam]),
    (["gpt2-124m", "--optimizer", "adafactor", "--state-mode", "bf16"],
     "--state-mode bf16 with --optimizer adafactor: SwapOptimizer: state_dtype=torch.bfloat16 works with elementwise "
     "optimizers"),
    (["gpt2-124m", "--optimizer", "muon", "--state-mode", "kahan"], "kahan_summation=True works with elementwise"),
    (["gpt2-124m", "--optimizer", "sgd", "--state-mode", "master"], "master_weights work(s) with Adam/AdamW only"),
    (["gpt2-124m", "--optimizer", "muon", "--world-size", "2"], "refuses Muon with DTensor params (FSDP2)"),
    (["gpt2-124m", "--optimizer", "adafactor", "--world-size", "2"], "refuses Adafactor with DTensor params"),
    (["gpt2-124m", "--optimizer", "adam", "--optimizer-args", "capturable=True"], "capturable=True"),
    (["gpt2-124m", "--optimizer", "sgd", "--optimizer-args", "momentum"], "'momentum' is not KEY=VALUE"),
    (["gpt2-124m", "--optimizer", "foo"], "invalid choice: 'foo'"),
    (["--device-memory", "8"], "name one model"),
    (["gpt2-124m", "--config", "x.json", "--device-memory", "8"], "name one model"),
    (["gpt2-124m", "--device-memory", "8", "--num-arenas", "1"], "--num-arenas must be >= 2"),
    (["gpt2-124m", "--host-reserve-gib", "-1"], "--host-reserve-gib must be >= 0"),
    (["gpt2-124m", "--host-memory", "4", "--host-reserve-gib", "4"], "leaves nothing of 4.00 GiB"),
])
def test_refuses_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit):
        plan.main(args)
    assert message in capsys.readouterr().err


# --optimizer: the state bytes per param element, fp32 params, derived from the declarations.
BYTES_PER_PARAM = [
    ("adamw", "", 8), ("adam", "", 8), ("adam", "amsgrad=True", 12), ("sgd", "", 0), ("sgd", "momentum=0.9", 4),
    ("adagrad", "", 4), ("rmsprop", "", 4), ("rmsprop", "momentum=0.9", 8), ("rmsprop", "centered=True", 8),
    ("rmsprop", "centered=True,momentum=0.9", 12), ("adadelta", "", 8), ("adamax", "", 8), ("nadam", "", 8),
    ("radam", "", 8), ("asgd", "", 4), ("rprop", "", 8), ("muon", "", 4),
]


@pytest.mark.parametrize("name, args, expected", BYTES_PER_PARAM)
def test_state_bytes_per_param_of_each_optimizer(tmp_path, name, args, expected):
    config = write_config(tmp_path, **TINY_LLAMA)
    report, rows = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", name,
                            "--optimizer-args", args)
    optimizer = report["optimizer"]
    assert optimizer["state_bytes_per_param"] == expected
    resident, swapped = rows[f"resident {optimizer['name']}"], rows["swapped"]
    assert resident["state_bytes_per_param"] == swapped["state_bytes_per_param"] == expected
    assert swapped["update"] == "torch"
    numel = optimizer["planned_params"]
    # the swapped state (params of min_numel or more) and the resident rest: every state byte, unaligned
    assert sum(row["host_state_bytes"] for row in [swapped]) <= expected * numel
    if expected == 0:
        assert swapped["host_state_bytes"] == swapped["batches"] == 0
    else:
        assert 0.9 * expected * numel < swapped["host_state_bytes"]


def test_adafactor_keeps_far_less_than_a_state_per_element(tmp_path):
    config = write_config(tmp_path, **TINY_LLAMA)
    report, rows = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", "adafactor")
    shapes = from_hf_config(config).param_shapes()
    # row_var (R values) and col_var (C values) for a matrix, variance (N values) for a vector: fp32
    factored = sum(4 * (shape[0] + shape[1] if len(shape) == 2 else shape[0]) for shape in shapes)
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    assert report["optimizer"]["state_bytes_per_param"] == pytest.approx(factored / numel)
    assert report["optimizer"]["state_bytes_per_param"] < 0.25  # 4 bytes an element were it not factored
    assert "row_var, col_var (whole)" in report["optimizer"]["states"]


def test_muon_plans_the_blocks_matrices_only(tmp_path, capsys):
    config = write_config(tmp_path, **TINY_LLAMA)
    report, _ = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", "muon")
    shapes = from_hf_config(config).param_shapes()
    matrices = [s for s in shapes if len(s) == 2 and s[0] != TINY_LLAMA["vocab_size"]]
    assert report["optimizer"]["planned_params"] == sum(torch.Size(s).numel() for s in matrices)
    assert "go to an AdamW beside it" in printed(capsys)


@pytest.mark.parametrize("name, args", [("sgd", "momentum=0.9"), ("rmsprop", "centered=True,momentum=0.9"),
                                        ("adafactor", "")])
def test_other_optimizers_rows_equal_memory_stats_of_a_real_step(tmp_path, name, args):
    config = write_config(tmp_path, **TINY_LLAMA)
    _, rows = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", name, "--optimizer-args", args,
                       "--swap-times", 4)
    torch.manual_seed(0)
    params = [torch.randn(shape, requires_grad=True) for shape in from_hf_config(config).param_shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = SwapOptimizer(plan.OPTIMIZERS[name](params, **plan.optimizer_args(args)), swap_times=4,
                              min_numel=1024)
    optimizer.step()
    stats, row = optimizer.memory_stats(), rows["swapped"]
    assert (row["host_state_bytes"], row["resident_state_bytes"], row["staging_bytes"], row["batches"]) == \
        (stats["host_state_bytes"], stats["resident_state_bytes"], stats["peak_staging_bytes"], stats["batches"])


def test_json_names_the_optimizer_and_each_rows_update(tmp_path):
    config = write_config(tmp_path, **TINY_LLAMA)
    report, rows = run_plan(tmp_path, "--config", config, "--optimizer", "adamw", "--device-memory", 8)
    assert set(report["optimizer"]) == {"name", "args", "states", "state_bytes_per_param", "planned_params"}
    assert report["optimizer"]["name"] == "AdamW" and report["optimizer"]["state_bytes_per_param"] == 4  # bf16
    assert {"update", "state_bytes_per_param"} <= set(rows["resident AdamW"])
    for name, row in rows.items():
        if name != "resident AdamW":
            assert {"update", "state_bytes_per_param", "update_temporary_bytes"} <= set(row), name
    # default states: torch's own update (no step table, its foreach temporaries counted); the rest: the packed kernel
    assert rows["swapped"]["update"] == "torch" and rows["swapped"]["step_table_bytes"] == 0
    assert rows["swapped"]["update_temporary_bytes"] > 0
    assert all(rows[f"swapped {mode}"]["update"] == "packed kernel" for mode in ("bf16", "8bit", "master", "kahan"))
    # two 1-byte moments plus their blocks' scales (tensors under MIN_QUANTIZED_NUMEL keep 2-byte moments)
    assert 2 < rows["swapped 8bit"]["state_bytes_per_param"] < 2.2


# Compact states and Kahan on torch's update path: (optimizer, its args, mode, --dtype). foreach=True: the
# planner plans torch's default path on CUDA, a CPU step runs the for-loop by default; both run foreach here.
# 16-bit params under bf16 or 8-bit states without Kahan are not cut on the CPU (cuts_16_bit_on_cpu), as they
# are on the planned GPU, so those modes are compared on fp32 params.
TORCH_UPDATE_MODES = [
    ("sgd", "momentum=0.9", "bf16", "fp32"), ("sgd", "momentum=0.9", "8bit", "fp32"),
    ("sgd", "momentum=0.9", "kahan", "bf16"), ("sgd", "momentum=0.9", "kahan+8bit", "bf16"),
    ("rmsprop", "momentum=0.9", "bf16", "fp32"), ("rmsprop", "momentum=0.9", "8bit", "fp32"),
    ("rmsprop", "", "kahan", "bf16"), ("rmsprop", "momentum=0.9", "kahan+8bit", "bf16"),
    ("adagrad", "", "8bit", "fp32"), ("adagrad", "", "kahan", "bf16"), ("adagrad", "", "kahan+8bit", "bf16"),
]


def swapped_on_cpu(shapes, dtype, name, args, mode, **settings):
    """SwapOptimizer over CPU params of `shapes` in state mode `mode`, after one step with random grads."""
    torch.manual_seed(0)
    params = [torch.randn(shape, dtype=plan.DTYPES[dtype]).requires_grad_() for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = SwapOptimizer(plan.OPTIMIZERS[name](params, **plan.optimizer_args(args)), min_numel=1024,
                              **plan.STATE_MODES[mode], **settings)
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("name, args, mode, dtype", TORCH_UPDATE_MODES)
def test_compact_and_kahan_rows_of_other_optimizers_equal_a_real_step(tmp_path, name, args, mode, dtype):
    """The planner's row in `mode`: its bytes per param, update temporaries
    (compact scratch and Kahan's float32 stand-in included) and store equal
    memory_stats() and the store of a SwapOptimizer laid out on real params."""
    config = write_config(tmp_path, **TINY_LLAMA)
    args = ",".join(filter(None, (args, "foreach=True")))
    report, rows = run_plan(tmp_path, "--config", config, "--dtype", dtype, "--optimizer", name,
                            "--optimizer-args", args, "--swap-times", 4, "--device-memory", 1, "--state-mode", mode)
    row = rows[f"swapped {mode}"]
    assert row["update"] == "torch"
    optimizer = swapped_on_cpu(from_hf_config(config).param_shapes(), dtype, name, args, mode, swap_times=4)
    stats = optimizer.memory_stats()
    views = optimizer._rule.views
    numel = sum(p.numel() for p in optimizer._params())
    assert row["state_bytes_per_param"] == sum(v.nbytes for entry in views for v in entry.values()) / numel
    assert (row["host_state_bytes"], row["resident_state_bytes"], row["staging_bytes"], row["batches"],
            row["update_temporary_bytes"]) == \
        (stats["host_state_bytes"], stats["resident_state_bytes"], stats["peak_staging_bytes"], stats["batches"],
         stats["update_temporary_bytes"])
    assert row["moved_bytes_each_way"] == stats["h2d_bytes"]
    # the compact forms move fewer bytes than the default states, Kahan more (the compensation)
    assert row["host_state_bytes"] != rows["swapped"]["host_state_bytes"]
    assert row["update_temporary_bytes"] > rows["swapped"]["update_temporary_bytes"]  # the scratch
    assert "best resident share " + mode in rows


@pytest.mark.parametrize("name, args, mode, dtype", TORCH_UPDATE_MODES)
def test_planner_and_rule_build_the_same_store(tmp_path, name, args, mode, dtype):
    """The planner's store (meta params) is the one TorchUpdateRule._lay_out
    builds (real params): the same keys, rows, scratch and 8-bit scale keys.
    (vocab 513: the embeddings' 32,832 elements end inside a block of 256.)"""
    model = from_hf_config(write_config(tmp_path, **dict(TINY_LLAMA, vocab_size=513)))
    planner = plan.Planner.make(model, plan.DTYPES[dtype], 1, StepCostModel.for_device(torch.device("cpu")),
                                plan.OPTIMIZERS[name], plan.optimizer_args(args))
    rule = swapped_on_cpu(model.param_shapes(), dtype, name, args, mode)._rule
    assert planner.store(mode) == (rule._keys, rule._state_rows, rule._scratch, rule._block_keys)
    assert any(planner.store(mode).scratch) and planner.store(mode) != planner.store("default")


def test_modes_whose_states_stay_exact_are_no_rows_and_say_so(tmp_path, capsys):
    """Adagrad's sum stays exact under bf16, Rprop keeps every state exact:
    SwapOptimizer takes those modes, and the planner shows no row that
    repeats another's store, but a note; --state-mode plans it all the same."""
    config = write_config(tmp_path, **TINY_LLAMA)
    report, rows = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", "adagrad",
                            "--device-memory", 1, "--state-mode", "bf16")
    assert set(rows) == {"resident Adagrad", "swapped", "swapped 8bit", "best resident share bf16"}
    note = "no 'swapped bf16' row: SwapOptimizer takes Adagrad with state_dtype=torch.bfloat16 and keeps the " \
           "store of 'swapped' (sum): the same bytes and update, as SwapOptimizer warns: state_dtype=torch.bfloat16: " \
           "Adagrad keeps no state worth compacting under its settings"
    out = printed(capsys)
    assert note in out and any(note in line for line in report["notes"])
    assert "--state-mode bf16:" not in out  # its warning is said once, in the row's note
    _, rows = run_plan(tmp_path, "--config", config, "--dtype", "bf16", "--optimizer", "rprop")
    assert set(rows) == {"resident Rprop", "swapped", "swapped kahan"}
    out = printed(capsys)
    for mode, same, dtype in (("bf16", "'swapped'", "torch.bfloat16"), ("8bit", "'swapped'", "torch.uint8"),
                              ("kahan+8bit", "'swapped kahan'", "torch.uint8")):
        assert f"no 'swapped {mode}' row: SwapOptimizer takes Rprop" in out
        assert f"keeps the store of {same}" in out and f"warns: state_dtype={dtype}: Rprop keeps no state" in out
    # SGD with bf16 params: its momentum_buffer is bf16 already under bf16 states (no warning: fp32 ones would be)
    report, rows = run_plan(tmp_path, "--config", config, "--optimizer", "sgd", "--optimizer-args", "momentum=0.9")
    assert set(rows) == {"resident SGD", "swapped", "swapped 8bit", "swapped kahan", "swapped kahan+8bit"}
    note = "no 'swapped bf16' row: SwapOptimizer takes SGD with state_dtype=torch.bfloat16 and keeps the store of " \
           "'swapped' (momentum_buffer): the same bytes and update, as the element states of bf16 params are bf16 " \
           "already"
    assert note in printed(capsys) and any(note in line for line in report["notes"])


MASTER = "'swapped master' (master_weights=True, state_dtype=torch.float32) row"


@pytest.mark.parametrize("name, refused", [
    ("sgd", {MASTER: "state_dtype, master_weights work(s) with Adam/AdamW only"}),
    ("adafactor", {"'swapped bf16' (state_dtype=torch.bfloat16) row": "state_dtype=torch.bfloat16 works with "
                                                                      "elementwise optimizers",
                   "'swapped 8bit' (state_dtype=torch.uint8), 'swapped kahan+8bit' (kahan_summation=True, "
                   "state_dtype=torch.uint8) rows": "state_dtype=torch.uint8 works with elementwise",
                   MASTER: "state_dtype, master_weights work(s) with Adam/AdamW only",
                   "'swapped kahan' (kahan_summation=True) row": "kahan_summation=True works with elementwise"}),
])
def test_modes_swapoptimizer_refuses_are_no_rows_and_say_why(tmp_path, capsys, name, refused):
    """A state mode SwapOptimizer refuses for the optimizer is a note with its
    settings and refusal (the same refusal once, naming every mode it refuses)."""
    name_of = {"sgd": "SGD", "adafactor": "Adafactor"}
    config = write_config(tmp_path, **TINY_LLAMA)
    report, rows = run_plan(tmp_path, "--config", config, "--optimizer", name)
    out = printed(capsys)
    for modes, refusal in refused.items():
        assert f"Note: no {modes}: SwapOptimizer refuses {name_of[name]} so: {refusal}" in out
        assert sum(line.startswith(f"Note: no {modes}") for line in report["notes"]) == 1
    for modes in refused:
        for mode in modes.split("'")[1::2]:
            assert mode not in rows


def test_the_chosen_state_modes_wrap_warnings_are_notes(tmp_path, capsys):
    """--state-mode plans what SwapOptimizer does with that setting, and says
    what it would warn when wrapping (kahan on fp32 params does nothing)."""
    config = write_config(tmp_path, **TINY_LLAMA)
    report, _ = run_plan(tmp_path, "--config", config, "--dtype", "fp32", "--optimizer", "sgd", "--optimizer-args",
                         "momentum=0.9", "--device-memory", 1, "--state-mode", "kahan")
    note = "Note: --state-mode kahan: kahan_summation=True applies to 16-bit params, and this optimizer has none; it " \
           "does nothing here."
    assert note in printed(capsys) and note in report["notes"]
    report, _ = run_plan(tmp_path, "--config", config, "--dtype", "bf16", "--optimizer", "sgd", "--optimizer-args",
                         "momentum=0.9", "--device-memory", 1, "--state-mode", "kahan")
    assert "--state-mode kahan:" not in printed(capsys)


def test_8bit_forms_are_decided_on_the_whole_param_under_fsdp2(tmp_path):
    """A 64 x 64 matrix (4,096 elements) keeps 8-bit codes under FSDP2 though
    each rank's shard has 2,048, as the rule decides on a DTensor's global numel."""
    model = from_hf_config(write_config(tmp_path, **TINY_LLAMA))
    planner = plan.Planner.make(model, torch.float32, 2, StepCostModel.for_device(torch.device("cpu")),
                                torch.optim.SGD, dict(momentum=0.9))
    store = planner.store("8bit")
    index = next(i for i, p in enumerate(planner.params) if tuple(p.shape) == (32, 64))
    kinds = {key: kind for key, kind, *_ in store.rows[index]}
    assert kinds["momentum_buffer_codes"] == "element" and kinds["momentum_buffer_absmax"] == "block"
    assert kinds["momentum_buffer"] == "absent"
