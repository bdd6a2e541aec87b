"""A trainer loop that publishes a .pulse patch of its BF16 weights after every step.

    python docs/examples/trainer.py OUT_DIR [--steps 5]

The model trains in FP32 (the master weights); inference workers run the BF16 cast, so the
trainer publishes the cast. Most BF16 words do not change from one step to the next, so each
patch is a small fraction of the checkpoint. See docs/examples/worker.py for the other side.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pulsectl.torch_api import Publisher


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(512, 64),
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 512),
    )


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-6)
    publisher = Publisher(level="max", metadata={"format": "pt"})
    fingerprint = publisher.anchor(bf16_state(model), args.out / "anchor.safetensors")
    print(f"anchor  {fingerprint}  {args.out / 'anchor.safetensors'}")

    tokens = torch.randint(0, 512, (64, 16))
    for step in range(1, args.steps + 1):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        path = args.out / f"step_{step:04d}.pulse"
        summary = publisher.publish(bf16_state(model), path)
        print(
            f"step {step}: loss {loss.item():.4f}, {summary.changed_words:,} of "
            f"{summary.total_words:,} BF16 words changed, patch {summary.patch_bytes:,} bytes "
            f"-> {path.name} (target {summary.target_fingerprint})"
        )


if __name__ == "__main__":
    main()
