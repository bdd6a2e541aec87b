"""PULSELoCo against DDP and DiLoCo on a small byte-level transformer LM (CPU, a few minutes).

    python benchmarks/loco_experiment.py [--seeds 0 1 2] [--rounds 48] [--inner 16]
        [--inner-lr 3e-6 [1e-6 1e-5 ...]] [--d-model 64] [--layers 2] [--context 64]
        [--out docs] [--threads 1] [--no-write]

The default (one learning rate, three seeds) takes about 6 minutes on one CPU thread, plus about
half a minute once to pretrain the base model (cached under --cache). Each further --inner-lr
adds as much again; the first one given is the main setting (the full table and the plot), the
others make a learning-rate sweep table.

Setup (an RL-style fine-tuning, scaled down):
- Corpus: the Python standard library's own source files, read as bytes (vocabulary 256).
  Files outside ``test/`` pretrain the base model; ``test/test_*.py`` files are the fine-tuning
  distribution, which differs from the pretraining one (the last 10% of them, by sorted path,
  are held out for validation).
- Model: a 2-layer pre-norm transformer, d=64, 4 heads, context 64 (137,216 parameters).
  FP32 master weights; forward and backward run on the BF16 cast of the weights (straight
  through), as a trainer publishing BF16 would. Base model: AdamW lr 3e-3, 1,500 steps of
  16 sequences (warm-up and cosine decay).
- Fine-tuning: M = 4 trainers, each with its own data stream, AdamW (betas 0.9/0.95, no weight
  decay; its state kept across rounds) at a small RL-like inner learning rate, from the same
  base model, for ``rounds * inner`` steps:
  (a) DDP: gradients averaged every step (4 bytes per parameter per step and trainer);
  (b) DiLoCo: ``inner`` local steps, dense FP32 pseudo-gradients averaged, outer Nesterov
      (lr 0.7, momentum 0.9); (c) PULSELoCo: the same, each trainer sending only the BF16-visible
      part with error feedback, through pulsectl.loco (encode -> patch bytes -> loads -> reduce ->
      outer_step); the bytes counted are the real .pulse patch sizes (up-link, per trainer).
- Seeds: each seed draws its own fine-tuning streams (trainer k, inner step t; identical across
  the methods and learning rates) and its own validation batches (8 x 32 sequences). Every
  method evaluates the BF16 cast of the global weights on them after every round. Losses are
  compared as reductions from the seed's own base loss, and as sample sd over the seeds.

Writes OUT/LOCO.md's results block (between the markers), OUT/loco.png (matplotlib, optional)
and the raw results, every round of every run, to OUT/loco_results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pulsectl import loco  # noqa: E402

VOCAB = 256
BATCH = 8  # sequences per trainer and step
TRAINERS = 4
PRETRAIN_LR = 3e-3
PRETRAIN_BATCH = 16
VAL_BATCHES = 8  # of 32 sequences, drawn per seed from the held-out files


@dataclass(frozen=True)
class Config:
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64
    pretrain_steps: int = 1500

    @property
    def tag(self) -> str:
        return (
            f"d{self.d_model}-l{self.layers}-h{self.heads}-c{self.context}-p{self.pretrain_steps}"
        )


CFG = Config()  # replaced from the command line in main()
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
    starts = rng.integers(0, data.size - CFG.context - 1, size=n)
    idx = starts[:, None] + np.arange(CFG.context + 1)[None, :]
    return torch.from_numpy(data[idx].astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(CFG.d_model)
        self.qkv = nn.Linear(CFG.d_model, 3 * CFG.d_model)
        self.proj = nn.Linear(CFG.d_model, CFG.d_model)
        self.ln2 = nn.LayerNorm(CFG.d_model)
        self.up = nn.Linear(CFG.d_model, 4 * CFG.d_model)
        self.down = nn.Linear(4 * CFG.d_model, CFG.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, CFG.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, CFG.d_model))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CFG.d_model)
        self.pos = nn.Parameter(torch.randn(CFG.context, CFG.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(CFG.layers))
        self.ln = nn.LayerNorm(CFG.d_model)
        self.head = nn.Linear(CFG.d_model, VOCAB)

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
        opt,
        lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / CFG.pretrain_steps)),
    )
    rng = np.random.default_rng(1234)
    for step in range(CFG.pretrain_steps):
        opt.zero_grad(set_to_none=True)
        loss = bf16_loss(model, batches(corpus, rng, PRETRAIN_BATCH))
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0:
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
    sent_bytes, avg_bytes, density, avg_density = [], [], [], []
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
            avg_density.append(avg.density)
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
            avg_density.append(1.0)
        global_, momentum = loco.outer_step(global_, update_for_step, momentum)
        for m in models:
            load(m, global_)
        losses.append(evaluate(eval_model, global_, val))
    return {
        "loss": losses,
        "bytes_per_sync": sent_bytes,
        "avg_bytes_per_sync": avg_bytes,
        "density": density,
        "avg_density": avg_density,
        "syncs_per_round": 1,
    }


# ---------------------------------------------------------------------------------------------
# Report

NAMES = {"ddp": "DDP (dense, every step)", "diloco": "DiLoCo", "pulseloco": "PULSELoCo"}


def _sd(x: list[float]) -> float:
    """Sample standard deviation over seeds (0 for a single seed)."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def summarize(runs_by_method: dict[str, list[dict]]) -> dict:
    """Per method: final loss, reduction from the base, bytes; and the comparisons."""
    out: dict = {}
    for method, runs in runs_by_method.items():
        finals = [run["loss"][-1] for run in runs]
        reductions = [run["loss"][0] - run["loss"][-1] for run in runs]
        total = [float(sum(run["bytes_per_sync"])) for run in runs]
        entry = {
            "base_loss_mean": float(np.mean([run["loss"][0] for run in runs])),
            "final_loss_mean": float(np.mean(finals)),
            "final_loss_sd": _sd(finals),
            "final_losses": finals,
            "reduction_mean": float(np.mean(reductions)),
            "reduction_sd": _sd(reductions),
            "reductions": reductions,
            "total_bytes_per_trainer": float(np.mean(total)),
            "bytes_per_sync": float(np.mean([np.mean(run["bytes_per_sync"]) for run in runs])),
            "syncs": len(runs[0]["bytes_per_sync"]),
        }
        if "density" in runs[0]:
            entry["density"] = float(np.mean([np.mean(run["density"]) for run in runs]))
            entry["avg_density"] = float(np.mean([np.mean(run["avg_density"]) for run in runs]))
            entry["avg_bytes_per_sync"] = float(
                np.mean([np.mean(run["avg_bytes_per_sync"]) for run in runs])
            )
        out[method] = entry
    if {"ddp", "diloco", "pulseloco"} <= set(out):
        d, p, ddp = out["diloco"], out["pulseloco"], out["ddp"]
        gaps = [(pf - df) / df for pf, df in zip(p["final_losses"], d["final_losses"], strict=True)]
        fracs = [pr / dr for pr, dr in zip(p["reductions"], d["reductions"], strict=True)]
        vs_diloco = d["total_bytes_per_trainer"] / p["total_bytes_per_trainer"]
        vs_ddp = ddp["total_bytes_per_trainer"] / p["total_bytes_per_trainer"]
        out["compare"] = {
            "gap_vs_diloco_mean": float(np.mean(gaps)),
            "gap_vs_diloco_worst": float(max(gaps)),
            "gaps": gaps,
            "reduction_fraction_mean": float(np.mean(fracs)),
            "reduction_fraction_sd": _sd(fracs),
            "reduction_fractions": fracs,
            "bytes_vs_diloco": vs_diloco,
            "bytes_vs_ddp": vs_ddp,
            "loss_target_met": bool(max(abs(g) for g in gaps) <= 0.01),
            "diloco_target_met": bool(vs_diloco >= 10),
            "ddp_target_met": bool(vs_ddp >= 100),
        }
    return out


def _yes(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def main_table(summary: dict, args: argparse.Namespace, params: int, lr: float) -> str:
    """The full table for one inner learning rate."""
    s_all = summary[f"{lr:g}"]
    pulse = s_all["pulseloco"]
    c = s_all["compare"]
    lines = [
        f"Main setting: inner lr {lr:g}. Model {params:,} parameters (d={CFG.d_model}, "
        f"{CFG.layers} layers, context {CFG.context}); {TRAINERS} trainers; {args.rounds} rounds "
        f"x H = {args.inner} inner AdamW steps (batch {BATCH}x{CFG.context} bytes per trainer "
        f"and step); seeds {', '.join(map(str, args.seeds))} (each seed: its own fine-tuning "
        f"streams and its own validation batches). Validation loss of the base model: "
        f"{pulse['base_loss_mean']:.4f} nats/byte (mean over the seeds' validation sets). "
        "sd: sample standard deviation over the seeds.",
        "",
        "| method | final val loss (mean ± sd) | reduction from base (mean ± sd) | syncs | "
        "bytes per sync and trainer | total bytes per trainer | PULSELoCo sends x fewer |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ("ddp", "diloco", "pulseloco"):
        s = s_all[key]
        ratio = s["total_bytes_per_trainer"] / pulse["total_bytes_per_trainer"]
        lines.append(
            f"| {NAMES[key]} | {s['final_loss_mean']:.5f} ± {s['final_loss_sd']:.5f} | "
            f"{s['reduction_mean']:.5f} ± {s['reduction_sd']:.5f} | {s['syncs']} | "
            f"{s['bytes_per_sync']:,.0f} | {s['total_bytes_per_trainer']:,.0f} | {ratio:.1f}x |"
        )
    fr = ", ".join(f"{f:.1%}" for f in c["reduction_fractions"])
    lines += [
        "",
        f"PULSELoCo sent {pulse['density']:.2%} of the values per sync and trainer on average "
        f"({pulse['bytes_per_sync'] / (pulse['density'] * params):.2f} bytes per sent value, "
        f"positions and FP32 values); the averaged patch every trainer receives back held "
        f"{pulse['avg_density']:.2%} of the values, {pulse['avg_bytes_per_sync']:,.0f} bytes per "
        "sync. PULSELoCo's loss reduction as a fraction of DiLoCo's: "
        f"{c['reduction_fraction_mean']:.1%} ± {c['reduction_fraction_sd']:.1%} (per seed: {fr}).",
        "",
        "Targets:",
        f"- final validation loss within 1% of DiLoCo's (every seed): mean "
        f"{c['gap_vs_diloco_mean']:+.3%}, worst seed {c['gap_vs_diloco_worst']:+.3%} -> "
        f"{_yes(c['loss_target_met'])}",
        f"- >= 10x fewer bytes than DiLoCo: {c['bytes_vs_diloco']:.1f}x -> "
        f"{_yes(c['diloco_target_met'])}",
        f"- >= 100x fewer bytes than dense per-step averaging: {c['bytes_vs_ddp']:.1f}x -> "
        f"{_yes(c['ddp_target_met'])}",
    ]
    return "\n".join(lines)


def sweep_table(summary: dict, lrs: list[float]) -> str:
    lines = [
        "Learning-rate sweep (same model, rounds, H and seeds; mean over the seeds; reduction = "
        "base loss - final loss, nats/byte):",
        "",
        "| inner lr | reduction DDP | reduction DiLoCo | reduction PULSELoCo | PULSELoCo / DiLoCo "
        "reduction | final loss vs DiLoCo (worst seed) | density sent | x fewer bytes vs DiLoCo "
        "| x fewer vs DDP | targets (loss / 10x / 100x) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lr in sorted(lrs):
        s = summary[f"{lr:g}"]
        c = s["compare"]
        marks = " / ".join(
            "met" if ok else "NOT"
            for ok in (c["loss_target_met"], c["diloco_target_met"], c["ddp_target_met"])
        )
        lines.append(
            f"| {lr:g} | {s['ddp']['reduction_mean']:.4f} ± {s['ddp']['reduction_sd']:.4f} | "
            f"{s['diloco']['reduction_mean']:.4f} ± {s['diloco']['reduction_sd']:.4f} | "
            f"{s['pulseloco']['reduction_mean']:.4f} ± {s['pulseloco']['reduction_sd']:.4f} | "
            f"{c['reduction_fraction_mean']:.1%} ± {c['reduction_fraction_sd']:.1%} | "
            f"{c['gap_vs_diloco_mean']:+.2%} ({c['gap_vs_diloco_worst']:+.2%}) | "
            f"{s['pulseloco']['density']:.2%} | {c['bytes_vs_diloco']:.1f}x | "
            f"{c['bytes_vs_ddp']:.1f}x | {marks} |"
        )
    return "\n".join(lines)


def plot(results: dict, args: argparse.Namespace, lrs: list[float], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return False
    main = results[f"{lrs[0]:g}"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
    ax1, ax2, ax3 = axes
    colors = {"ddp": "tab:gray", "diloco": "tab:blue", "pulseloco": "tab:red"}
    labels = {"ddp": "DDP", "diloco": "DiLoCo", "pulseloco": "PULSELoCo"}
    steps = np.arange(args.rounds + 1) * args.inner
    for key, runs in main.items():
        # Reduction from each seed's own base loss: the seeds' validation sets differ.
        curves = np.array([np.asarray(run["loss"]) - run["loss"][0] for run in runs])
        base = float(np.mean([run["loss"][0] for run in runs]))
        ax1.plot(steps, base + curves.mean(0), color=colors[key], label=labels[key])
        ax1.fill_between(
            steps, base + curves.min(0), base + curves.max(0), color=colors[key], alpha=0.15
        )
        cum = np.array([np.cumsum(run["bytes_per_sync"]) for run in runs]).mean(0)
        syncs_per_round = runs[0]["syncs_per_round"]
        ax2.plot(
            cum[syncs_per_round - 1 :: syncs_per_round],
            base + curves.mean(0)[1:],
            color=colors[key],
            label=labels[key],
        )
    ax1.set_xlabel("inner steps")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title(f"global model (BF16 cast), inner lr {lrs[0]:g}\nmean and range over seeds")
    ax1.legend()
    ax2.set_xscale("log")
    ax2.set_xlabel("cumulative bytes sent per trainer")
    ax2.set_ylabel("validation loss (nats/byte)")
    ax2.set_title("loss against communication")
    ax2.legend()
    for i, lr in enumerate(lrs):
        runs = results[f"{lr:g}"].get("pulseloco", [])
        if not runs:
            continue
        dens = np.array([run["density"] for run in runs]).mean(0)
        ax3.plot(
            np.arange(1, dens.size + 1),
            dens * 100,
            color=plt.cm.viridis(i / max(1, len(lrs) - 1)),
            label=f"lr {lr:g}",
        )
    ax3.axhline(8, color="k", ls=":", lw=0.8)
    ax3.set_yscale("log")
    ax3.set_xlabel("round")
    ax3.set_ylabel("% of values sent per trainer")
    ax3.set_title(
        "PULSELoCo: values sent per sync and trainer\n"
        "(dotted: 8%, about 10x fewer bytes than DiLoCo)"
    )
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
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
    global CFG
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--inner", type=int, default=16, help="H, inner steps per round")
    ap.add_argument(
        "--inner-lr",
        type=float,
        nargs="+",
        default=[3e-6],
        help="one or more inner learning rates (a sweep); the first is the main setting",
    )
    ap.add_argument("--methods", nargs="+", default=["ddp", "diloco", "pulseloco"])
    ap.add_argument("--d-model", type=int, default=Config.d_model)
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--heads", type=int, default=Config.heads)
    ap.add_argument("--context", type=int, default=Config.context)
    ap.add_argument("--pretrain-steps", type=int, default=Config.pretrain_steps)
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path("/tmp/pulsectl-loco"),
        help="folder for the pretrained base model (one file per model config)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = ap.parse_args()
    CFG = Config(args.d_model, args.layers, args.heads, args.context, args.pretrain_steps)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    pre, finetune, valdata = load_corpus()
    print(
        f"corpus: {pre.size:,} pretraining bytes, {finetune.size:,} fine-tuning, "
        f"{valdata.size:,} validation",
        file=sys.stderr,
    )
    base = pretrain(pre, args.cache / f"base-{CFG.tag}.npz")
    params = sum(v.size for v in base.values())
    print(f"base model: {params:,} parameters ({time.time() - t0:.0f} s)", file=sys.stderr)
    lrs = list(args.inner_lr)
    results: dict[str, dict[str, list[dict]]] = {
        f"{lr:g}": {m: [] for m in args.methods} for lr in lrs
    }
    for seed in args.seeds:
        torch.manual_seed(seed)
        data = trainer_data(finetune, seed, args.rounds, args.inner)
        vrng = np.random.default_rng([seed, 99])
        val = [batches(valdata, vrng, 32) for _ in range(VAL_BATCHES)]
        for lr in lrs:
            for method in args.methods:
                t = time.time()
                if method == "ddp":
                    run = run_ddp(base, data, val, args.rounds, args.inner, lr)
                else:
                    sparse = method == "pulseloco"
                    run = run_loco(base, data, val, args.rounds, args.inner, lr, sparse)
                results[f"{lr:g}"][method].append(run)
                extra = f", density {np.mean(run['density']):.3%}" if method == "pulseloco" else ""
                print(
                    f"seed {seed} lr {lr:g} {method}: loss {run['loss'][0]:.4f} -> "
                    f"{run['loss'][-1]:.4f}, {sum(run['bytes_per_sync']):,.0f} bytes{extra} "
                    f"({time.time() - t:.0f} s)",
                    file=sys.stderr,
                )
    summary = {lr: summarize(runs) for lr, runs in results.items()}
    if len(args.methods) == 3:
        text = main_table(summary, args, params, lrs[0])
        if len(lrs) > 1:
            text += "\n\n" + sweep_table(summary, lrs)
    else:
        text = json.dumps(summary, indent=2)
    print(text)
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    if args.no_write:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    raw = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "config": asdict(CFG) | {"params": params, "trainers": TRAINERS, "batch": BATCH},
        "summary": summary,
        "runs": results,
    }
    (args.out / "loco_results.json").write_text(json.dumps(raw, indent=1))
    plot(results, args, lrs, args.out / "loco.png")
    command = "python benchmarks/loco_experiment.py " + " ".join(sys.argv[1:])
    write_markdown(args.out / "LOCO.md", text, command.strip())


if __name__ == "__main__":
    main()
