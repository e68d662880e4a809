"""A request's answer comes from its own inputs, always: the batcher on the real exported models.

Sixteen concurrent clients, each with its own values and one of two shapes, through the
batching :class:`~staronnx.Server` on a :class:`~staronnx.Runtime`: every answer must equal
ONNX Runtime's answer to that client's own inputs. The models are the kinds users bring
(``models/real/``): a batch on axis 1 of a state with a scalar per-request input,
dynamic sizes, a fixed batch of 1, data-dependent outputs, and the issue's OCR model exported
with a fixed batch of 1 and a time-major output declared wrongly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import realmodels
from staronnx import MachineSpec, Runtime, RuntimeSpec, ServeSpec, Server, partition
from staronnx.plan import Plan
from staronnx.partition import PartitionSpec

CLIENTS = 16


def _serve_concurrently(plan: Plan, name, clients: int = CLIENTS, batch_size: int = 4):
    """Each client submits its own request at once; returns (requests, answers, batch records)."""
    reqs = [realmodels.request(name, c) if not str(name).endswith(".onnx") else realmodels.fixed_request(c)
            for c in range(clients)]
    with Runtime(plan, MachineSpec(groups="1"), RuntimeSpec(policy="eager")) as rt, \
            Server(rt, ServeSpec(batch_size, max_delay=0.03, queue_capacity=64)) as server:
        with ThreadPoolExecutor(8) as pool:
            futures = list(pool.map(server.submit, reqs))
        answers = [f.result(timeout=60) for f in futures]
        records = server.records()
    return reqs, answers, records


@pytest.mark.parametrize("name", realmodels.NAMES)
def test_each_client_gets_its_own_answer(real_plan, name):
    plan = real_plan(name)
    reqs, answers, records = _serve_concurrently(plan, name)
    for feeds, got in zip(reqs, answers):
        realmodels.assert_own_answer(name, feeds, got)
    assert not any(r.failed for r in records.requests)
    sizes = [b.size for b in records.batches]
    if name in realmodels.ONE_PER_TASK:
        assert set(sizes) == {1}, f"{name} cannot batch, yet batches of {sizes} ran"
    else:
        assert max(sizes) > 1, f"{name} can batch, yet every batch held one request: {sizes}"
    # requests only share a batch with requests of their own shape (and per-request values)
    by_id = {r.id: i for i, r in enumerate(records.requests)}
    for b in records.batches:
        variants = {[c % 2 for c in range(CLIENTS)][by_id[i]] for i in b.request_ids}
        assert len(variants) == 1, f"batch {b.id} mixes shapes: clients {sorted(by_id[i] for i in b.request_ids)}"


def test_fixed_batch_time_major_model_never_hands_out_another_answer(tmp_path):
    """The issue's defect: four concurrent requests, four images, four copies of the first
    image's answer. The model's input is fixed to batch 1: one request per task."""
    model = realmodels.fixed_batch_time_major(tmp_path)
    plan = partition(str(model), spec=PartitionSpec(input_shapes=["image=1x1x32x148"], profile_runs=1),
                     output_dir=tmp_path / "plan")
    assert not plan.contract.batchable
    reqs, answers, records = _serve_concurrently(plan, model, clients=8)
    for feeds, got in zip(reqs, answers):
        realmodels.assert_own_answer(model, feeds, got)
    assert [b.size for b in records.batches] == [1] * 8
    # and no two clients of one shape got the same answer
    same = [a["log_probs"] for c, a in enumerate(answers) if c % 2 == 0]
    assert not any(np.array_equal(same[0], other) for other in same[1:])


def test_state_batch_axis_one_and_scalar_input_batch_apart(real_plan):
    """gru_stream: the state carries the batch on axis 1, the sample rate is a scalar per
    request: requests of different sample rates never share a batch, and a batch's state is
    split along axis 1."""
    plan = real_plan("gru_stream")
    assert plan.contract.inputs == {"frame": 0, "state": 1, "sample_rate": None}
    assert plan.contract.outputs == {"prob": 0, "state_out": 1}
    reqs, answers, records = _serve_concurrently(plan, "gru_stream")
    for feeds, got in zip(reqs, answers):
        assert got["state_out"].shape == (2, 1, 64)
        realmodels.assert_own_answer("gru_stream", feeds, got)


def test_batch_axis_override_and_no_batching(real_plan):
    """What the graph cannot tell, the user says: --no-batching serves one request per task."""
    plan = Plan.load(real_plan("unet_seg").root).set_batching(batching=False)
    assert not plan.contract.batchable and "off" in plan.contract.why_not
    reqs, answers, records = _serve_concurrently(plan, "unet_seg", clients=6)
    for feeds, got in zip(reqs, answers):
        realmodels.assert_own_answer("unet_seg", feeds, got)
    assert {b.size for b in records.batches} == {1}


def test_perf_model_footprints_leave_out_each_tensors_batch_axis(real_plan):
    """StarPU keys a perf model by footprint; staronnx leaves the batch out of it so one family
    holds every batch size of one set of other sizes. gru_stream's state [2, batch, 64] has its
    batch on axis 1: batch 1 and 3 are one family for every part, and a wider input is another."""
    from staronnx.perfmodels import Footprint
    from staronnx.verify import random_plan_feeds

    plan = real_plan("gru_stream")

    def hashes(b: int) -> list[int]:
        values = plan.reference_values(random_plan_feeds(plan, b))
        return [Footprint.of_feeds(plan.part_feeds(p, values), b, plan.part_batch_axes(p)).shape_hash
                for p in range(plan.k)]

    assert hashes(1) == hashes(3)
    crnn = real_plan("crnn_ocr")
    narrow = Footprint.of_feeds({"image": np.zeros((2, 1, 32, 148), np.float32)}, 2, crnn.part_batch_axes(0))
    wide = Footprint.of_feeds({"image": np.zeros((2, 1, 32, 200), np.float32)}, 2, crnn.part_batch_axes(0))
    assert narrow.shape_hash != wide.shape_hash
