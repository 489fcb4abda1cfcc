"""accelerate's FSDP2 plugin under torch's and veragged's fully_shard: same losses, same weights.

See _accel.py for the user code (cpu_ram_efficient_loading from rank 0, FULL_STATE_DICT
save_state/load_state, get_state_dict, clip_grad_norm_) and the launcher's CPU switch. 2 gloo
ranks, 4 steps, then step 3 replayed after load_state. Losses and weights bitwise: with 2 ranks
each gradient element is a sum of two addends in both implementations and AdamW is element-wise;
the clip norm (a sum over each rank's own shard, whose boundaries differ) is compared to 1e-5
relative, and max_norm never binds, so its last bits reach nothing else.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/install_test.sh)")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/install_test.sh)")

from tests.clients import _accel  # noqa: E402
from tests.clients._launch import client_pool, compare  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_accelerate_fsdp2_plugin_matches_torch(tmp_path):
    pool = client_pool(2)
    ref = pool.run(_accel.run, "torch", str(tmp_path))
    res = pool.run(_accel.run, "veragged", str(tmp_path))
    assert any("RaggedShard" in k for k in res[0]["kinds"]), res[0]["kinds"]
    for rank in range(2):
        compare(f"accelerate rank {rank}", ref[rank]["loss"], res[rank]["loss"])
        compare(f"accelerate grad norm rank {rank}", ref[rank]["norm"], res[rank]["norm"], 1e-5)
        # load_state restored the step-2 model and optimizer: step 3 again gives its loss
        assert ref[rank]["replayed"] == ref[rank]["loss"][2], ref[rank]
        assert res[rank]["replayed"] == res[rank]["loss"][2], res[rank]
    want, got = ref[0]["state"], res[0]["state"]
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{key} differs after training"
