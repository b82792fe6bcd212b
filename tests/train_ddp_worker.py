"""One rank of the data-parallel training test (run by ``torchrun`` from tests/test_train_ddp.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/train_ddp_worker.py OUT_ROOT STEPS
"""

import sys
from pathlib import Path

import torch
from test_train_ddp import ddp_cfg, tiny_prompts, tiny_target

from ddtree.train import run

if __name__ == "__main__":
    torch.set_num_threads(1)
    root, steps = Path(sys.argv[1]), int(sys.argv[2])
    run(ddp_cfg(root, steps), target=tiny_target(), prompts=tiny_prompts(ddp_cfg(root, steps).num_prompts),
        log_fn=lambda m: None)
