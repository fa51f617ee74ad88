"""One rank of `harness.launch`: `python -m tests.distributed.worker module:fn out_dir args`."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
from pathlib import Path


def main() -> None:
    target, out_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    module, name = target.split(":")
    value = getattr(importlib.import_module(module), name)(rank, world, out_dir, *args)
    (out_dir / f"result{rank}.json").write_text(json.dumps(value))
    dist.destroy_process_group()
    # skip the interpreter's teardown: on a loaded machine gloo's threads, torn down by
    # C++ static destructors, now and then abort the process ("terminate called without
    # an active exception") after its work is done and written
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
