# Saves state dicts of today's Adam store (commit 0c690bf) so later code can prove it still loads them.
import torch, swap_optimizer as so
def model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8)).to(dtype)
out = {}
for name, cls, kw, dtype, cfg in [
    ("adamw_fp32", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), torch.float32, {}),
    ("adam_amsgrad_fp32", torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01), torch.float32, {}),
    ("adamw_bf16_states", torch.optim.AdamW, dict(lr=1e-2), torch.bfloat16, dict(state_dtype=torch.bfloat16, rounding_seed=7)),
    ("adamw_8bit_states", torch.optim.AdamW, dict(lr=1e-2), torch.float32, dict(state_dtype=torch.uint8, min_numel=1)),
]:
    m = model(dtype)
    opt = so.SwapOptimizer(cls(m.parameters(), **kw), swap_times=2, **cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    out[name] = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "optimizer": opt.state_dict(),
                 "kwargs": kw, "config": {k: v for k, v in cfg.items()}, "dtype": dtype}
torch.save(out, "/work/main/tests/data/adam_store_checkpoints.pt")
print({k: sorted(v["optimizer"]["state"][0].keys()) for k, v in out.items()})
print(out["adamw_fp32"]["optimizer"]["state"][0]["step"], out["adamw_fp32"]["optimizer"]["param_groups"][0].keys())
