"""PULSELoCo against DDP and DiLoCo on a tiny byte-level transformer LM (CPU, a few minutes).

    python benchmarks/loco_experiment.py [--seeds 0 1 2] [--rounds 8] [--inner 16]
        [--inner-lr 2e-6] [--out docs] [--threads 1]

Setup (an RL-style fine-tuning, scaled down):
- Corpus: the Python standard library's own source files, read as bytes (vocabulary 256).
  Files outside ``test/`` pretrain the base model; ``test/test_*.py`` files are the fine-tuning
  distribution (the last 10% of them, by sorted path, are held out for validation).
- Model: a 2-layer pre-norm transformer, d=32, 2 heads, context 32 (~35K parameters).
  FP32 master weights; forward and backward run on the BF16 cast of the weights (straight
  through), as a trainer publishing BF16 would. Base model: AdamW lr 3e-3, a few hundred steps.
- Fine-tuning: M = 4 trainers, each with its own data stream, AdamW at a small RL-like inner
  learning rate (default 2e-6), from the same base model, for ``rounds * inner`` steps:
  (a) DDP: gradients averaged every step (4 bytes per parameter per step and trainer);
  (b) DiLoCo: ``inner`` local steps, dense FP32 pseudo-gradients averaged, outer Nesterov
      (lr 0.7, momentum 0.9); (c) PULSELoCo: the same, each trainer sending only the BF16-visible
      part with error feedback, through pulsectl.loco (encode -> patch bytes -> loads -> reduce ->
      outer_step); the bytes counted are the real .pulse patch sizes.
- Every method sees the same batches (trainer k, inner step t) and evaluates the BF16 cast of
  the global weights on the same held-out batches after every round.

Writes OUT/LOCO.md's results table (between markers) and OUT/loco.png (matplotlib, optional),
and the raw results to OUT/loco_results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pulsectl import loco  # noqa: E402

VOCAB = 256
CONTEXT = 32
D_MODEL = 32
LAYERS = 2
HEADS = 2
BATCH = 8  # sequences per trainer and step
TRAINERS = 4
PRETRAIN_STEPS = 400
PRETRAIN_LR = 3e-3
VAL_BATCHES = 8
MARK_BEGIN = "<!-- loco-results:begin -->"
MARK_END = "<!-- loco-results:end -->"


# ---------------------------------------------------------------------------------------------
# Data


def load_corpus() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pretraining bytes, fine-tuning bytes, validation bytes) from the stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    tests = [p for p in files if "test" in p.parts and p.name.startswith("test_")]
    base = [p for p in files if "test" not in p.parts and "tests" not in p.parts]
    cut = int(len(tests) * 0.9)

    def read(paths: list[Path]) -> np.ndarray:
        return np.frombuffer(b"\n".join(p.read_bytes() for p in paths), dtype=np.uint8)

    return read(base), read(tests[:cut]), read(tests[cut:])


def batches(data: np.ndarray, rng: np.random.Generator, n: int) -> torch.Tensor:
    starts = rng.integers(0, data.size - CONTEXT - 1, size=n)
    idx = starts[:, None] + np.arange(CONTEXT + 1)[None, :]
    return torch.from_numpy(data[idx].astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.up = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.down = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D_MODEL))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def bf16_loss(model: TinyLM, batch: torch.Tensor) -> torch.Tensor:
    """Loss with the weights as their BF16 cast (straight-through: grads reach the FP32 master)."""
    params = {
        n: p + (p.detach().to(torch.bfloat16).float() - p.detach())
        for n, p in model.named_parameters()
    }
    logits = torch.func.functional_call(model, params, (batch[:, :-1],))
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: TinyLM, weights: dict[str, np.ndarray], val: list[torch.Tensor]) -> float:
    load(model, weights)
    return float(np.mean([bf16_loss(model, b).item() for b in val]))


def weights_of(model: TinyLM) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@torch.no_grad()
def load(model: TinyLM, weights: dict[str, np.ndarray]) -> None:
    for n, p in model.named_parameters():
        p.copy_(torch.from_numpy(weights[n]))


def inner_optimizer(model: TinyLM, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_steps(model: TinyLM, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for batch in data:
        opt.zero_grad(set_to_none=True)
        bf16_loss(model, batch).backward()
        opt.step()


def pretrain(corpus: np.ndarray, cache: Path) -> dict[str, np.ndarray]:
    """The shared base model (cached: deterministic for a given torch build)."""
    if cache.exists():
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    torch.manual_seed(1234)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / PRETRAIN_STEPS))
    )
    rng = np.random.default_rng(1234)
    for step in range(PRETRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = bf16_loss(model, batches(corpus, rng, 16))
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"  pretrain step {step}: loss {loss.item():.3f}", file=sys.stderr)
    weights = weights_of(model)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **weights)
    return weights


# ---------------------------------------------------------------------------------------------
# The three methods


def trainer_data(
    finetune: np.ndarray, seed: int, rounds: int, inner: int
) -> list[list[torch.Tensor]]:
    """Batches per trainer, for every inner step: identical across the methods."""
    out = []
    for k in range(TRAINERS):
        rng = np.random.default_rng([seed, k])
        out.append([batches(finetune, rng, BATCH) for _ in range(rounds * inner)])
    return out


def run_ddp(base, data, val, rounds, inner, lr) -> dict:
    model = TinyLM()
    load(model, base)
    opt = inner_optimizer(model, lr)
    n = sum(v.size for v in base.values())
    losses = [evaluate(model, base, val)]
    load(model, base)
    for r in range(rounds):
        for t in range(r * inner, (r + 1) * inner):
            # The mean of the trainers' mean losses: their averaged gradient (all-reduce).
            train_steps(model, opt, [torch.cat([d[t] for d in data])])
        losses.append(evaluate(model, weights_of(model), val))
    per_sync = 4 * n  # FP32 gradients, every step
    return {
        "loss": losses,
        "bytes_per_sync": [per_sync] * (rounds * inner),
        "syncs_per_round": inner,
    }


def run_loco(base, data, val, rounds, inner, lr, sparse: bool, visible: str = "bf16") -> dict:
    models = [TinyLM() for _ in range(TRAINERS)]
    for m in models:
        load(m, base)
    opts = [inner_optimizer(m, lr) for m in models]
    global_ = {k: v.copy() for k, v in base.items()}
    momentum = None
    residuals: list[dict[str, np.ndarray] | None] = [None] * TRAINERS
    eval_model = TinyLM()
    losses = [evaluate(eval_model, global_, val)]
    sent_bytes, avg_bytes, density = [], [], []
    n = sum(v.size for v in base.values())
    for r in range(rounds):
        locals_ = []
        for k, (m, opt) in enumerate(zip(models, opts, strict=True)):
            train_steps(m, opt, data[k][r * inner : (r + 1) * inner])
            locals_.append(weights_of(m))
        if sparse:
            received = []
            up = 0
            for k, local in enumerate(locals_):
                update, residuals[k] = loco.encode(global_, local, residuals[k], visible=visible)
                patch = loco.dumps(update)  # what trainer k puts on the wire
                up += len(patch)
                received.append(loco.loads(patch))
            avg = loco.reduce(received)
            sent_bytes.append(up / TRAINERS)
            avg_bytes.append(len(loco.dumps(avg)))
            density.append(float(np.mean([u.density for u in received])))
            update_for_step = avg
        else:
            # Dense FP32 average, the same arithmetic as loco.reduce: sum in order, then / M.
            update_for_step = {}
            for name in global_:
                acc = np.zeros_like(global_[name])
                for local in locals_:
                    acc = acc + np.subtract(global_[name], local[name])
                update_for_step[name] = acc / np.float32(TRAINERS)
            sent_bytes.append(4 * n)
            avg_bytes.append(4 * n)
            density.append(1.0)
        global_, momentum = loco.outer_step(global_, update_for_step, momentum)
        for m in models:
            load(m, global_)
        losses.append(evaluate(eval_model, global_, val))
    return {
        "loss": losses,
        "bytes_per_sync": sent_bytes,
        "avg_bytes_per_sync": avg_bytes,
        "density": density,
        "syncs_per_round": 1,
    }


# ---------------------------------------------------------------------------------------------
# Report


def summarize(results: dict, params: int) -> dict:
    out = {}
    for method, runs in results.items():
        finals = [run["loss"][-1] for run in runs]
        total = [sum(run["bytes_per_sync"]) for run in runs]
        per_sync = [float(np.mean(run["bytes_per_sync"])) for run in runs]
        entry = {
            "final_loss_mean": float(np.mean(finals)),
            "final_loss_std": float(np.std(finals)),
            "final_losses": finals,
            "total_bytes_per_trainer": float(np.mean(total)),
            "bytes_per_sync": float(np.mean(per_sync)),
            "syncs": len(runs[0]["bytes_per_sync"]),
        }
        if "density" in runs[0]:
            entry["density"] = float(np.mean([np.mean(run["density"]) for run in runs]))
            entry["avg_bytes_per_sync"] = float(
                np.mean([np.mean(run["avg_bytes_per_sync"]) for run in runs])
            )
        out[method] = entry
    return out


def table(summary: dict, args: argparse.Namespace, params: int, base_loss: float) -> str:
    names = {"ddp": "DDP (dense, every step)", "diloco": "DiLoCo", "pulseloco": "PULSELoCo"}
    pulse = summary["pulseloco"]
    lines = [
        f"Model {params:,} parameters; {TRAINERS} trainers; {args.rounds} rounds x H = "
        f"{args.inner} inner AdamW steps (lr {args.inner_lr:g}, batch {BATCH}x{CONTEXT} bytes "
        f"per trainer); seeds {', '.join(map(str, args.seeds))}. Validation loss of the base "
        f"model: {base_loss:.4f} nats/byte.",
        "",
        "| method | final val loss (mean ± sd) | syncs | bytes per sync and trainer | "
        "total bytes per trainer | vs PULSELoCo |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("ddp", "diloco", "pulseloco"):
        s = summary[key]
        ratio = s["total_bytes_per_trainer"] / pulse["total_bytes_per_trainer"]
        lines.append(
            f"| {names[key]} | {s['final_loss_mean']:.4f} ± {s['final_loss_std']:.4f} | "
            f"{s['syncs']} | {s['bytes_per_sync']:,.0f} | {s['total_bytes_per_trainer']:,.0f} | "
            f"{ratio:.1f}x |"
        )
    d, p, ddp = summary["diloco"], pulse, summary["ddp"]
    gap = (p["final_loss_mean"] - d["final_loss_mean"]) / d["final_loss_mean"]
    vs_diloco = d["total_bytes_per_trainer"] / p["total_bytes_per_trainer"]
    vs_ddp = ddp["total_bytes_per_trainer"] / p["total_bytes_per_trainer"]
    lines += [
        "",
        f"PULSELoCo sent {p['density']:.2%} of the values per sync on average "
        f"({p['bytes_per_sync'] / (p['density'] * params):.2f} bytes per sent value, "
        f"positions and FP32 values); the averaged patch every trainer receives back was "
        f"{p['avg_bytes_per_sync']:,.0f} bytes per sync.",
        "",
        f"Loss reduction from the base model: DDP {base_loss - ddp['final_loss_mean']:.4f}, "
        f"DiLoCo {base_loss - d['final_loss_mean']:.4f}, PULSELoCo "
        f"{base_loss - p['final_loss_mean']:.4f} nats/byte. At an RL-like learning rate the "
        "loss moves little in this many steps, so the 1% criterion is a weak test; the "
        "reduction PULSELoCo achieves relative to DiLoCo's is the more telling figure.",
        "",
        "Targets:",
        f"- final validation loss within 1% of DiLoCo: {gap:+.2%} -> "
        f"{'met' if abs(gap) <= 0.01 else 'NOT met'}",
        f"- >= 10x fewer bytes than DiLoCo: {vs_diloco:.1f}x -> "
        f"{'met' if vs_diloco >= 10 else 'NOT met'}",
        f"- >= 100x fewer bytes than dense per-step averaging: {vs_ddp:.1f}x -> "
        f"{'met' if vs_ddp >= 100 else 'NOT met'}",
    ]
    return "\n".join(lines)


def plot(results: dict, args: argparse.Namespace, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"ddp": "tab:gray", "diloco": "tab:blue", "pulseloco": "tab:red"}
    labels = {"ddp": "DDP", "diloco": "DiLoCo", "pulseloco": "PULSELoCo"}
    steps = np.arange(args.rounds + 1) * args.inner
    for key, runs in results.items():
        curves = np.array([run["loss"] for run in runs])
        ax1.plot(steps, curves.mean(0), color=colors[key], label=labels[key])
        ax1.fill_between(steps, curves.min(0), curves.max(0), color=colors[key], alpha=0.15)
        cum = np.array([np.cumsum(run["bytes_per_sync"]) for run in runs]).mean(0)
        x = np.arange(1, cum.size + 1) * (args.inner * args.rounds / cum.size)
        ax2.plot(x, cum, color=colors[key], label=labels[key])
    ax1.set_xlabel("inner steps")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title("loss of the global model (BF16 cast)")
    ax1.legend()
    ax2.set_yscale("log")
    ax2.set_xlabel("inner steps")
    ax2.set_ylabel("bytes sent per trainer (cumulative)")
    ax2.set_title("communication")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_markdown(path: Path, text: str, command: str) -> None:
    block = f"{MARK_BEGIN}\n\nReproduce: `{command}`\n\n{text}\n\n{MARK_END}"
    doc = path.read_text() if path.exists() else f"# PULSELoCo\n\n{MARK_BEGIN}\n{MARK_END}\n"
    if MARK_BEGIN in doc and MARK_END in doc:
        head, rest = doc.split(MARK_BEGIN, 1)
        doc = head + block + rest.split(MARK_END, 1)[1]
    else:
        doc += "\n" + block + "\n"
    path.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--inner", type=int, default=16, help="H, inner steps per round")
    ap.add_argument("--inner-lr", type=float, default=2e-6)
    ap.add_argument("--methods", nargs="+", default=["ddp", "diloco", "pulseloco"])
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/pulsectl-loco/base-d32-c32.npz"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    pre, finetune, valdata = load_corpus()
    print(
        f"corpus: {pre.size:,} pretraining bytes, {finetune.size:,} fine-tuning, "
        f"{valdata.size:,} validation",
        file=sys.stderr,
    )
    base = pretrain(pre, args.cache)
    params = sum(v.size for v in base.values())
    val = [batches(valdata, np.random.default_rng(99), 32) for _ in range(VAL_BATCHES)]
    base_loss = evaluate(TinyLM(), base, val)
    print(f"base model: {params:,} parameters, val loss {base_loss:.4f}", file=sys.stderr)
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        torch.manual_seed(seed)
        data = trainer_data(finetune, seed, args.rounds, args.inner)
        for method in args.methods:
            t = time.time()
            if method == "ddp":
                run = run_ddp(base, data, val, args.rounds, args.inner, args.inner_lr)
            else:
                sparse = method == "pulseloco"
                run = run_loco(base, data, val, args.rounds, args.inner, args.inner_lr, sparse)
            results[method].append(run)
            extra = f", density {np.mean(run['density']):.3%}" if method == "pulseloco" else ""
            print(
                f"seed {seed} {method}: final loss {run['loss'][-1]:.4f}, "
                f"{sum(run['bytes_per_sync']):,.0f} bytes{extra} ({time.time() - t:.0f} s)",
                file=sys.stderr,
            )
    summary = summarize(results, params)
    text = table(summary, args, params, base_loss) if len(args.methods) == 3 else ""
    print(text or json.dumps(summary, indent=2))
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    if args.no_write:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    raw = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": results}
    (args.out / "loco_results.json").write_text(json.dumps(raw, indent=1))
    plot(results, args, args.out / "loco.png")
    command = "python benchmarks/loco_experiment.py " + " ".join(sys.argv[1:])
    write_markdown(args.out / "LOCO.md", text, command.strip())


if __name__ == "__main__":
    main()
