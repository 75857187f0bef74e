#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with TensorBoard's own reader (EventAccumulator) and
prints one JSON line: every scalar tag with its (step, value) pairs, and the text tags.

Usage: python scripts/tensorboard-peer.py RUN_DIR/tensorboard
(the crates/kiln/tests/suite/tensorboard.rs test runs it when KILN_TORCH_PYTHON has tensorboard)
"""

import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    scalars = {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in tags["scalars"]}
    texts = {t: [e.step for e in ea.Tensors(t)] for t in tags.get("tensors", [])}
    import tensorboard
    print(json.dumps({"tensorboard": tensorboard.__version__, "scalars": scalars, "texts": texts}))


if __name__ == "__main__":
    main()
