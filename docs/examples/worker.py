"""An inference worker that applies the trainer's patches to its live BF16 model, in place.

    python docs/examples/worker.py OUT_DIR

It loads the anchor into an nn.Module once, then applies each step_*.pulse to the module's
parameters directly (no checkpoint is rebuilt on disk). A patch made against another state is
refused before any weight is touched.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file
from trainer import make_model  # the same architecture as the trainer (docs/examples/)

from pulsectl.torch_api import apply_patch, state_dict_fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()

    model = make_model().to(torch.bfloat16)
    model.load_state_dict(load_file(args.out / "anchor.safetensors"))
    weights = model.state_dict()  # shares storage with the parameters
    for path in sorted(args.out.glob("step_*.pulse")):
        target = apply_patch(weights, path)
        assert state_dict_fingerprint(model.state_dict(), {"format": "pt"}) == target
        print(f"applied {path.name}: model now at {target}")


if __name__ == "__main__":
    main()
