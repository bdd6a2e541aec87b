"""Synthetic checkpoint chains that change the way an RL trainer's BF16 checkpoints change.

A trainer keeps FP32 master weights, takes AdamW steps of about ``lr`` per weight and
publishes the BF16 cast after every step. A word of the cast changes only when the master
crosses a BF16 rounding boundary, so how many words change per step follows from the Adam step
size against the BF16 spacing at each weight's magnitude. This module reproduces that
mechanism, not a target number: weight scales like trained LLM weights (linear ~ 1.7/sqrt(fan_in)
with a log-normal spread across rows, embeddings ~ 0.025, norms ~ 1, small biases), AdamW with
moments and bias correction, and gradients made of a slowly drifting per-weight signal plus
fresh noise each step (noise dominates, as in RL), scaled per tensor and by a per-step norm
that varies from batch to batch. k-step changes thus build up with some coherence.

By default the optimizer starts warm (moments at their long-run statistics, bias correction
as after many steps), as in the middle of a run; ``warm_start=False`` starts from zero moments
like step 1 of a fresh run, whose first steps move every weight by about ``lr``.

Memory: tensors are processed one at a time in chunks, and the state kept per parameter is the
FP32 master, Adam's two FP32 moments and an FP16 gradient signal (14 bytes): about 6.9 GB for
"qwen2.5-0.5b", plus one BF16 copy of the model (about 1 GB) while a step is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pulsectl.checkpoint import save_safetensors
from pulsectl.floats import f32_to_bf16

SAFETENSORS_METADATA = {"format": "pt"}  # what transformers writes into every shard
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

_CHUNK = 1 << 22  # elements per pass, so that temporaries stay at a few tens of MiB
_WARM_STEPS = 10_000  # optimizer age assumed by a warm start (bias corrections ~1)
_LINEAR_GAIN = 1.7  # linear weights ~ N(0, gain / sqrt(fan_in)), like trained LLM weights
_EMBED_STD = 0.025  # embeddings (tied or not) ~ N(0, 0.025)
_SIGNAL = 0.2  # gradient signal amplitude relative to the per-step noise
_STEP_SPREAD = 0.5  # log-normal sigma of the per-step gradient norm (batches differ)
_DRIFT = 0.99  # per-step autocorrelation of the signal (it decorrelates over ~100 steps)
_ROW_SPREAD = 0.4  # log-normal sigma of per-row scales: trained weights mix magnitudes
_EPS = 1e-8

# Stream tags for the random generators, so init and steps never share a stream.
_TAG_INIT = 0
_TAG_STEP = 1
_TAG_NORM = 2


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2/Llama-style decoder: sizes that fix every tensor's name and shape."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Total number of parameters."""
        return sum(math.prod(s) for s in shapes(self).values())


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(256, 32, 64, 2, 4, 2, tie_embeddings=False),
    "small": ModelShape(8192, 256, 1024, 6, 8, 2, tie_embeddings=True),
    "qwen2.5-0.5b": ModelShape(151936, 896, 4864, 24, 14, 2, tie_embeddings=True),
    "qwen2.5-7b": ModelShape(152064, 3584, 18944, 28, 28, 4, tie_embeddings=False),
}


def _resolve(shape: str | ModelShape) -> ModelShape:
    if isinstance(shape, ModelShape):
        return shape
    try:
        return PRESETS[shape]
    except KeyError:
        raise ValueError(f"unknown model shape {shape!r}; presets: {', '.join(PRESETS)}") from None


def shapes(shape: str | ModelShape) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in Hugging Face Qwen2 naming, in state-dict order."""
    s = _resolve(shape)
    if s.hidden % s.heads or s.heads % s.kv_heads:
        raise ValueError(f"{s}: hidden must divide by heads and heads by kv_heads")
    kv = s.kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (s.hidden, s.hidden)
        out[p + "self_attn.q_proj.bias"] = (s.hidden,)
        out[p + "self_attn.k_proj.weight"] = (kv, s.hidden)
        out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.weight"] = (kv, s.hidden)
        out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (s.hidden, s.hidden)
        out[p + "mlp.gate_proj.weight"] = (s.intermediate, s.hidden)
        out[p + "mlp.up_proj.weight"] = (s.intermediate, s.hidden)
        out[p + "mlp.down_proj.weight"] = (s.hidden, s.intermediate)
        out[p + "input_layernorm.weight"] = (s.hidden,)
        out[p + "post_attention_layernorm.weight"] = (s.hidden,)
    out["model.norm.weight"] = (s.hidden,)
    if not s.tie_embeddings:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


@dataclass
class _TensorState:
    """One tensor's trainer state, flat: FP32 master, Adam moments, drifting gradient signal."""

    shape: tuple[int, ...]
    master: np.ndarray
    m: np.ndarray
    v: np.ndarray
    signal: np.ndarray  # float16, unit variance
    grad_scale: float


def _rng(seed: int, tensor: int, tag: int, step: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, tensor, tag, step])))


def _init_tensor(
    name: str, shape: tuple[int, ...], index: int, seed: int, warm: bool, beta1: float
) -> _TensorState:
    """Weights at realistic scales and, if ``warm``, moments at their long-run statistics."""
    rng = _rng(seed, index, _TAG_INIT)
    n = math.prod(shape)
    master = np.empty(n, dtype=np.float32)
    if name.endswith("norm.weight"):
        master[:] = rng.standard_normal(n, dtype=np.float32)
        master *= 0.05
        master += 1.0
    elif len(shape) == 1:  # biases
        master[:] = rng.standard_normal(n, dtype=np.float32)
        master *= 0.02
    else:  # matrices, with a log-normal scale per output row
        rows, cols = shape
        std = _EMBED_STD if name.endswith("embed_tokens.weight") else _LINEAR_GAIN / math.sqrt(cols)
        row_scale = np.exp(_ROW_SPREAD * rng.standard_normal(rows)).astype(np.float32) * std
        step_rows = max(1, _CHUNK // cols)
        for r0 in range(0, rows, step_rows):
            r1 = min(rows, r0 + step_rows)
            block = master[r0 * cols : r1 * cols].reshape(r1 - r0, cols)
            block[:] = rng.standard_normal((r1 - r0, cols), dtype=np.float32)
            block *= row_scale[r0:r1, None]
    grad_scale = float(10.0 ** rng.uniform(-4.0, -2.0))
    signal = np.empty(n, dtype=np.float16)
    m = np.zeros(n, dtype=np.float32)
    v = np.zeros(n, dtype=np.float32)
    noise_in_m = math.sqrt((1 - beta1) / (1 + beta1))  # std of an EMA of unit white noise
    mean_norm = math.exp(_STEP_SPREAD**2 / 2)  # E[c] and sqrt(E[c^2]) of the log-normal
    rms_norm = math.exp(_STEP_SPREAD**2)  # per-step gradient norm c
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        s = rng.standard_normal(b - a, dtype=np.float32)
        signal[a:b] = s
        if warm:
            z = rng.standard_normal(b - a, dtype=np.float32)
            z *= noise_in_m * rms_norm
            z += mean_norm * _SIGNAL * s
            z *= grad_scale
            m[a:b] = z
    if warm:
        v[:] = (grad_scale * rms_norm) ** 2 * (1.0 + _SIGNAL**2)
    return _TensorState(shape, master, m, v, signal, grad_scale)


def _adamw_step(
    st: _TensorState,
    rng: np.random.Generator,
    grad_norm: float,
    t: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """One AdamW step (torch's formulation) on a synthetic gradient, chunk by chunk."""
    beta1, beta2 = betas
    bc1 = 1 - beta1**t
    sqrt_bc2 = math.sqrt(1 - beta2**t)
    keep = 1 - lr * weight_decay
    drift_noise = math.sqrt(1 - _DRIFT**2)
    n = st.master.size
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        s = st.signal[a:b].astype(np.float32)
        s *= _DRIFT
        s += drift_noise * rng.standard_normal(b - a, dtype=np.float32)
        st.signal[a:b] = s
        g = rng.standard_normal(b - a, dtype=np.float32)
        g += _SIGNAL * s
        g *= st.grad_scale * grad_norm
        m, v, w = st.m[a:b], st.v[a:b], st.master[a:b]
        m *= beta1
        m += (1 - beta1) * g
        g *= g
        v *= beta2
        v += (1 - beta2) * g
        denom = np.sqrt(v)
        denom /= sqrt_bc2
        denom += _EPS
        if keep != 1:
            w *= keep
        np.divide(m, denom, out=denom)
        denom *= lr / bc1
        w -= denom


def _shard_of(sizes: Sequence[int], n: int) -> list[int]:
    """Shard index per tensor: contiguous groups of about equal bytes, none empty."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"shards must be between 1 and the number of tensors ({len(sizes)})")
    total = sum(sizes)
    out: list[int] = []
    shard, filled = 0, 0
    for i, size in enumerate(sizes):
        left = len(sizes) - i
        if (
            filled
            and shard < n - 1
            and (filled >= total * (shard + 1) / n or left == n - 1 - shard)
        ):
            shard += 1
        out.append(shard)
        filled += size
    return out


def _config(s: ModelShape, torch_dtype: str) -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": 32768,
        "model_type": "qwen2",
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": s.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "vocab_size": s.vocab,
    }


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def _write_checkpoint(
    path: Path,
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]],
    shards: int | None,
    model: ModelShape,
) -> None:
    """One checkpoint: a single .safetensors file, or an HF directory of ``shards`` files."""
    if shards is None:
        save_safetensors(path, tensors, SAFETENSORS_METADATA)
        return
    path.mkdir(exist_ok=True)
    names = list(tensors)
    sizes = [tensors[k][2].nbytes for k in names]
    groups: list[dict[str, tuple[str, tuple[int, ...], np.ndarray]]] = [{} for _ in range(shards)]
    for name, shard in zip(names, _shard_of(sizes, shards), strict=True):
        groups[shard][name] = tensors[name]
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors(path / file_name, group, SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(group, file_name))
    dtype = next(iter(tensors.values()))[0]
    _write_json(path / CONFIG_NAME, _config(model, "bfloat16" if dtype == "BF16" else "float32"))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    _write_json(path / INDEX_NAME, index)


def generate_chain(
    out_dir: str | Path,
    shape: str | ModelShape = "tiny",
    steps: int = 5,
    lr: float = 3e-6,
    seed: int = 0,
    weight_decay: float = 0.0,
    save_fp32: bool = False,
    shards: int | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    progress: Callable[[int, int], None] | None = None,
    warm_start: bool = True,
) -> list[Path]:
    """Write a BF16 checkpoint chain ``step_000`` .. ``step_{steps}`` and return its paths.

    ``step_000`` is the initial state; ``step_k`` is the BF16 cast of the FP32 master after k
    AdamW steps. Each is ``step_XXX.safetensors``, or with ``shards`` an HF directory
    ``step_XXX/`` (shards, ``model.safetensors.index.json``, ``config.json``). ``save_fp32``
    also writes the masters as ``step_XXX.f32.safetensors`` (or ``step_XXX.f32/``); they are
    not in the returned list. Same arguments, same bytes. ``progress(done, total)`` is called
    after each checkpoint is written.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    model = _resolve(shape)
    named = shapes(model)
    if shards is not None:
        _shard_of([1] * len(named), shards)  # reject a bad count before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    width = max(3, len(str(steps)))
    suffix = "" if shards else ".safetensors"
    f32_suffix = ".f32" if shards else ".f32.safetensors"

    states = {
        name: _init_tensor(name, shp, i, seed, warm_start, betas[0])
        for i, (name, shp) in enumerate(named.items())
    }
    t0 = _WARM_STEPS if warm_start else 0
    paths: list[Path] = []
    for step in range(steps + 1):
        if step:
            grad_norm = math.exp(_STEP_SPREAD * _rng(seed, 0, _TAG_NORM, step).standard_normal())
            for i, st in enumerate(states.values()):
                rng = _rng(seed, i, _TAG_STEP, step)
                _adamw_step(st, rng, grad_norm, t0 + step, lr, betas, weight_decay)
        stem = f"step_{step:0{width}d}"
        bf16 = {k: ("BF16", st.shape, f32_to_bf16(st.master)) for k, st in states.items()}
        _write_checkpoint(out / (stem + suffix), bf16, shards, model)
        del bf16
        if save_fp32:
            f32 = {k: ("F32", st.shape, st.master) for k, st in states.items()}
            _write_checkpoint(out / (stem + f32_suffix), f32, shards, model)
        paths.append(out / (stem + suffix))
        if progress is not None:
            progress(step + 1, steps + 1)
    return paths
