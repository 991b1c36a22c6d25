"""LatentStore (the hidden-state mirror's storage) against a naive reference: a dict slot -> row.

Runs on CPU in CI; on a CUDA machine the same file also covers the device mirror (Triton kernel and
its torch fallback), the host mirror's copy pipeline, no-host-sync writes and CUDA-graph capture.
The Triton kernel itself is also checked on CPU through Triton's interpreter (in a subprocess).
On a GPU machine (no vLLM needed): `PYTHONPATH=. python3 -m benchmarks.gpu_latent_store` runs this
file and fails if any CUDA or Triton test was skipped (docs/benchmarks.md, "Latent store on a GPU").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from omni_cache.cache.latent_store import LatentStore

CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    TRITON = True
except Exception:  # pragma: no cover
    TRITON = False

SPECS = {
    "hidden": (96, torch.bfloat16),  # 192-byte rows: copied as complex128 words on the torch path
    "tap": (40, torch.float32),
    "odd": (3, torch.bfloat16),  # 6-byte rows: int16 words
}
NUM_BLOCKS, BLOCK_SIZE = 48, 16
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE

# (id, device, storage, extra kwargs)
CONFIGS = [
    pytest.param("cpu", "host", {}, id="cpu-host"),
    pytest.param("cpu", "device", {}, id="cpu-device"),
    # The host pipeline's ring/drain-thread logic, emulated on CPU (synchronous "copies").
    pytest.param(
        "cpu", "host", {"_emulate_pipeline": True, "staging_tokens": 24, "staging_depth": 2}, id="cpu-pipeline-emulated"
    ),
]
if CUDA:
    CONFIGS += [
        pytest.param("cuda", "device", {"use_triton": False}, id="cuda-device-torch"),
        pytest.param("cuda", "host", {"use_triton": False}, id="cuda-host-torch"),
        pytest.param("cuda", "host", {"use_driver": False}, id="cuda-host-torch-issue"),
        pytest.param(
            "cuda",
            "host",
            {"drain_threads": None, "staging_tokens": 8, "staging_depth": 3},
            id="cuda-host-all-threads-tiny-ring",
        ),
    ]
    if TRITON:
        CONFIGS += [
            pytest.param("cuda", "device", {"use_triton": True}, id="cuda-device-triton"),
            pytest.param("cuda", "host", {}, id="cuda-host-zero-copy"),
            pytest.param("cuda", "host", {"host_gather": "staging"}, id="cuda-host-staging"),
            pytest.param("cuda", "host", {"staging_tokens": 24, "staging_depth": 2}, id="cuda-host-small-ring"),
        ]


class Reference:
    """The naive model: a dict slot -> row per name; later writes win, -1 is skipped."""

    def __init__(self, specs):
        self.rows = {n: {} for n in specs}

    def write(self, slot_mapping, latents):
        slots = slot_mapping.cpu().tolist()
        for name, table in self.rows.items():
            src = latents[name].cpu()
            for i, s in enumerate(slots):
                if s >= 0:
                    table[s] = src[i].clone()

    def gather(self, slots):
        return {n: torch.stack([t[s] for s in slots.cpu().tolist()]) for n, t in self.rows.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor (exact comparison, NaN payloads included)."""
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_rows_equal(got, want):
    assert set(got) == set(want)
    for name in want:
        d, dt = SPECS[name] if name in SPECS else (want[name].shape[1], want[name].dtype)
        assert got[name].dtype == want[name].dtype, name
        assert tuple(got[name].shape) == tuple(want[name].shape), name
        assert torch.equal(bits(got[name]), bits(want[name])), f"rows of {name!r} differ"


def random_latents(n_rows, device, gen, specs=SPECS, raw_bits=False):
    out = {}
    for name, (d, dt) in specs.items():
        if raw_bits:  # every bit pattern, NaNs and infinities included
            ints = torch.randint(-(2**15), 2**15, (n_rows, d * dt.itemsize // 2), generator=gen, dtype=torch.int32).to(
                torch.int16
            )
            t = ints.view(dt)
        else:
            t = torch.randn(n_rows, d, generator=gen).to(dt)
        out[name] = t.to(device)
    return out


def random_slot_mapping(n, gen, pad_frac=0.2, device="cpu", dtype=torch.int64):
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:n]
    pad = torch.rand(n, generator=gen) < pad_frac
    slots[pad] = -1
    return slots.to(dtype).to(device)


def make_store(device, storage, kw, specs=SPECS):
    return LatentStore(specs, NUM_BLOCKS, BLOCK_SIZE, storage=storage, device=device, **kw)


@pytest.fixture
def store_factory():
    made = []

    def factory(*args, **kw):
        s = make_store(*args, **kw)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.close()


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device,storage,kw", CONFIGS)
@pytest.mark.parametrize("raw_bits", [False, True], ids=["randn", "rawbits"])
def test_random_steps_match_reference(device, storage, kw, raw_bits, store_factory):
    gen = torch.Generator().manual_seed(1234)
    store = store_factory(device, storage, kw)
    ref = Reference(SPECS)
    written: list[int] = []
    for step in range(12):
        n = [1, 7, 33, 60, 0, 100, 5, 64, 17, 90, 2, 48][step]
        sm = random_slot_mapping(n, gen, device=device, dtype=torch.int32 if step % 3 == 1 else torch.int64)
        # rows beyond n (e.g. cudagraph padding) must be ignored
        lat = random_latents(n + 5, device, gen, raw_bits=raw_bits)
        store.write(sm, lat)
        ref.write(sm, {k: v[:n] for k, v in lat.items()})
        written += [s for s in sm.cpu().tolist() if s >= 0]
        # gather in the same step: a mix of this step's slots and older ones
        if written:
            pick = torch.randint(0, len(written), (min(40, len(written)),), generator=gen)
            slots = torch.tensor(written, dtype=torch.int64)[pick]
            got = store.gather(slots.to(device) if step % 2 else slots)
            assert all(t.device.type == torch.device(device).type for t in got.values())
            assert_rows_equal(got, ref.gather(slots))
    store.synchronize()
    slots = torch.tensor(sorted(set(written)), dtype=torch.int64)
    assert_rows_equal(store.gather(slots), ref.gather(slots))


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
def test_overwrite_of_reused_slots_later_write_wins(device, storage, kw, store_factory):
    gen = torch.Generator().manual_seed(7)
    store = store_factory(device, storage, kw)
    ref = Reference(SPECS)
    block = 5  # a block freed by vLLM and refilled by another request, several times
    for _ in range(4):
        sm = torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE, device=device)
        lat = random_latents(BLOCK_SIZE, device, gen)
        store.write(sm, lat)
        ref.write(sm, lat)
    # partial overwrite of the block's first half, with padding rows in between
    sm = torch.tensor([block * BLOCK_SIZE + i if i % 3 else -1 for i in range(BLOCK_SIZE // 2)], device=device)
    lat = random_latents(BLOCK_SIZE // 2, device, gen)
    store.write(sm, lat)
    ref.write(sm, lat)
    slots = LatentStore.prefix_slots([block], BLOCK_SIZE, BLOCK_SIZE)
    assert_rows_equal(store.gather(slots), ref.gather(slots))


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
def test_same_step_prefix_hit(device, storage, kw, store_factory):
    """Request A computes its prompt this step; request B (same step) hits A's full blocks and the
    non-aligned rest. B's gather must see A's write issued just before."""
    gen = torch.Generator().manual_seed(3)
    store = store_factory(device, storage, kw)
    prompt = 2 * BLOCK_SIZE + 5
    blocks_a = [11, 3, 40]
    sm = LatentStore.prefix_slots(blocks_a, BLOCK_SIZE, prompt).to(device)
    # the batch also holds a decode token of another request and two padding rows
    sm = torch.cat([sm, torch.tensor([7 * BLOCK_SIZE + 2, -1, -1], device=device)])
    lat = random_latents(sm.shape[0], device, gen)
    store.write(sm, lat)
    hit = prompt - 1  # a fully cached prompt still recomputes its last token
    got = store.gather(LatentStore.prefix_slots(blocks_a, BLOCK_SIZE, hit))
    assert_rows_equal(got, {n: t[:hit].cpu() for n, t in lat.items()})
    # a resumed request that already holds its first 20 rows asks only for the rest
    got = store.gather(LatentStore.prefix_slots(blocks_a, BLOCK_SIZE, hit, start=20))
    assert_rows_equal(got, {n: t[20:hit].cpu() for n, t in lat.items()})


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
def test_copy_blocks_is_ordered_between_writes(device, storage, kw, store_factory):
    """vLLM's copy-on-write of a shared block: the copy sees the writes before it, and a write
    after it (this step's rows) lands on top of the copy."""
    gen = torch.Generator().manual_seed(6)
    store = store_factory(device, storage, kw)
    src = LatentStore.prefix_slots([5], BLOCK_SIZE, BLOCK_SIZE).to(device)
    before = random_latents(BLOCK_SIZE, device, gen)
    store.write(src, before)
    store.copy_blocks([(5, 9)])
    tail = torch.tensor([9 * BLOCK_SIZE + BLOCK_SIZE - 1], device=device)
    after = random_latents(1, device, gen)
    store.write(tail, after)
    store.write(src, random_latents(BLOCK_SIZE, device, gen))  # the source moves on
    got = store.gather(LatentStore.prefix_slots([9], BLOCK_SIZE, BLOCK_SIZE))
    want = {n: torch.cat([t[:-1].cpu(), after[n].cpu()]) for n, t in before.items()}
    assert_rows_equal(got, want)
    store.copy_blocks([])


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
def test_gather_to_cpu_and_empty(device, storage, kw, store_factory):
    gen = torch.Generator().manual_seed(5)
    store = store_factory(device, storage, kw)
    sm = torch.arange(10, 30, device=device)
    lat = random_latents(20, device, gen)
    store.write(sm, lat)
    got = store.gather(torch.arange(12, 18), device="cpu")
    assert all(t.device.type == "cpu" for t in got.values())
    assert_rows_equal(got, {n: t[2:8].cpu() for n, t in lat.items()})
    empty = store.gather(torch.empty(0, dtype=torch.int64))
    assert set(empty) == set(SPECS)  # every name, so the shapes below are all checked
    assert all(t.shape == (0, SPECS[n][0]) for n, t in empty.items())
    store.write(torch.empty(0, dtype=torch.int64, device=device), {n: t[:0] for n, t in lat.items()})


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
def test_gather_into_given_buffers(device, storage, kw, store_factory):
    """gather(out=) fills the caller's rows (e.g. the head of a longer host buffer) in place, and
    refuses a buffer of the wrong shape or dtype by name."""
    gen = torch.Generator().manual_seed(6)
    store = store_factory(device, storage, kw)
    lat = random_latents(20, device, gen)
    store.write(torch.arange(10, 30, device=device), lat)
    whole = {n: torch.full((9, d), 7, dtype=dt) for n, (d, dt) in SPECS.items()}
    got = store.gather(torch.arange(12, 18), out={n: t[:6] for n, t in whole.items()})
    assert all(got[n].data_ptr() == whole[n].data_ptr() for n in SPECS)
    assert_rows_equal({n: t[:6] for n, t in whole.items()}, {n: t[2:8].cpu() for n, t in lat.items()})
    assert all(bool((t[6:] == 7).all()) for t in whole.values())  # rows past M untouched
    wrong = {n: torch.empty(5, d, dtype=dt) for n, (d, dt) in SPECS.items()}
    with pytest.raises(ValueError, match="gather out"):
        store.gather(torch.arange(12, 18), out=wrong)


@pytest.mark.parametrize("device,storage,kw", CONFIGS)
@pytest.mark.parametrize("num_tokens", [3, BLOCK_SIZE, 5 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7])
def test_gather_prefix_equals_gathering_its_slots(device, storage, kw, num_tokens, store_factory):
    """gather_prefix (whole blocks at a time, then the tail row by row) gives exactly the rows of
    the prefix's slots, for prefixes of part of a block, whole blocks, and blocks plus a tail."""
    gen = torch.Generator().manual_seed(7)
    store = store_factory(device, storage, kw)
    store.write(torch.arange(NUM_SLOTS, device=device), random_latents(NUM_SLOTS, device, gen, raw_bits=True))
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:6].tolist()
    want = store.gather(LatentStore.prefix_slots(block_ids, BLOCK_SIZE, num_tokens), device="cpu")
    out = {n: torch.full((num_tokens, d), 7, dtype=dt) for n, (d, dt) in SPECS.items()}
    got = store.gather_prefix(block_ids, num_tokens, out)
    assert all(got[n].data_ptr() == out[n].data_ptr() for n in SPECS)
    assert_rows_equal(got, want)
    with pytest.raises(ValueError, match="gather out"):
        store.gather_prefix(block_ids, num_tokens, {n: t[1:] for n, t in out.items()})


def test_prefix_slots():
    bs = 4
    table = [9, 2, 7]
    assert LatentStore.prefix_slots(table, bs, 0).tolist() == []
    assert LatentStore.prefix_slots(table, bs, 1).tolist() == [36]
    assert LatentStore.prefix_slots(table, bs, 6).tolist() == [36, 37, 38, 39, 8, 9]
    assert LatentStore.prefix_slots(table, bs, 12).tolist() == [36, 37, 38, 39, 8, 9, 10, 11, 28, 29, 30, 31]
    assert LatentStore.prefix_slots(table, bs, 10, start=5).tolist() == [9, 10, 11, 28, 29]
    assert LatentStore.prefix_slots(table, bs, 8, start=4).tolist() == [8, 9, 10, 11]
    assert LatentStore.prefix_slots(table, bs, 5, start=5).tolist() == []
    t = LatentStore.prefix_slots(torch.tensor(table, dtype=torch.int32), bs, 7, start=1)
    assert t.dtype == torch.int64 and t.tolist() == [37, 38, 39, 8, 9, 10]
    # the block table may be longer than needed (blocks allocated for tokens not computed yet)
    assert LatentStore.prefix_slots(table + [5, 6], bs, 3).tolist() == [36, 37, 38]
    with pytest.raises(ValueError):
        LatentStore.prefix_slots(table, bs, 13)


@pytest.mark.parametrize("storage", ["host", "device"])
def test_nbytes_names_and_view(storage):
    store = LatentStore(SPECS, NUM_BLOCKS, BLOCK_SIZE, storage=storage)
    assert store.names == ("hidden", "tap", "odd")
    assert store.num_blocks == NUM_BLOCKS and store.block_size == BLOCK_SIZE
    # one spare row per name absorbs padding writes (slot -1)
    expected = sum((NUM_SLOTS + 1) * d * dt.itemsize for d, dt in SPECS.values())
    assert store.nbytes == expected
    view = store.tensor("tap")
    assert view.shape == (NUM_BLOCKS, BLOCK_SIZE, 40) and view.dtype == torch.float32
    store.write(torch.tensor([BLOCK_SIZE + 3]), {n: torch.ones(1, d, dtype=dt) for n, (d, dt) in SPECS.items()})
    assert view[1, 3].eq(1).all() and view.sum() == 40


def test_write_validates_inputs():
    store = LatentStore(SPECS, NUM_BLOCKS, BLOCK_SIZE)
    lat = {n: torch.zeros(4, d, dtype=dt) for n, (d, dt) in SPECS.items()}
    with pytest.raises(KeyError, match="odd"):
        store.write(torch.arange(4), {k: v for k, v in lat.items() if k != "odd"})
    with pytest.raises(ValueError):
        store.write(torch.arange(5), lat)  # fewer rows than slots
    # another dtype is converted to the spec's
    store.write(torch.arange(4), {**lat, "tap": torch.full((4, 40), 2.0, dtype=torch.float64)})
    assert store.gather(torch.arange(4))["tap"].eq(2).all()


def test_pipeline_gather_waits_only_for_the_writes_it_needs(store_factory):
    """Emulated host pipeline: hold the copies of two writes, release one; a gather of that one's
    slots returns while the other is still held; a gather of the other's slots waits for it."""

    class Gate:
        def __init__(self):
            self.ev = threading.Event()

        def record(self, stream=None):
            pass

        def synchronize(self):
            assert self.ev.wait(timeout=30)

        def query(self):
            return self.ev.is_set()

    store = store_factory("cpu", "host", {"_emulate_pipeline": True, "staging_tokens": 64, "staging_depth": 3})
    gen = torch.Generator().manual_seed(11)
    gates = [Gate(), Gate()]
    for e, g in zip(store._pipeline.entries, gates):
        e.data_done = g
    lat_a, lat_b = random_latents(16, "cpu", gen), random_latents(16, "cpu", gen)
    store.write(torch.arange(0, 16), lat_a)  # entry 0 (held)
    store.write(torch.arange(16, 32), lat_b)  # entry 1 (held)
    gates[0].ev.set()
    got = store.gather(torch.arange(0, 16))  # needs entry 0 only
    assert_rows_equal(got, lat_a)
    waits = store.stats["gather_waits"]  # (the first gather may have waited for entry 0's copy)
    result = {}
    t = threading.Thread(target=lambda: result.update(store.gather(torch.arange(16, 32))))
    t.start()
    # The gather counts its wait as it starts waiting. Until it has (a thread slow to start on a
    # loaded machine), entry 1's copy stays held: released sooner, its rows would be in before
    # the gather looked, and it would not wait at all.
    deadline = time.monotonic() + 30
    while store.stats["gather_waits"] == waits:
        assert time.monotonic() < deadline, "the gather of rows still in flight never waited"
        time.sleep(0.01)
    t.join(timeout=0.3)
    assert t.is_alive(), "gather of rows still in flight must wait for their copy"
    gates[1].ev.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert_rows_equal(result, lat_b)
    assert store.stats["gather_waits"] >= 1  # the second gather waited (the first may not have)


def test_pipeline_chunking_and_ring_backpressure(store_factory):
    store = store_factory("cpu", "host", {"_emulate_pipeline": True, "staging_tokens": 10, "staging_depth": 2})
    assert store.staging_nbytes == 2 * (80 + sum(((10 * d * dt.itemsize + 15) // 16) * 16 for d, dt in SPECS.values()))
    gen = torch.Generator().manual_seed(2)
    ref = Reference(SPECS)
    for _ in range(5):
        sm = random_slot_mapping(57, gen)  # 6 chunks per write through a ring of 2
        lat = random_latents(57, "cpu", gen)
        store.write(sm, lat)
        ref.write(sm, lat)
    store.synchronize()
    assert store.stats["chunks"] == 30
    slots = torch.tensor(sorted(ref.rows["hidden"]), dtype=torch.int64)
    assert_rows_equal(store.gather(slots), ref.gather(slots))


@pytest.mark.skipif(not TRITON, reason="triton not importable")
def test_triton_kernel_in_interpreter():
    """The Triton kernel's logic (write skipping -1, gather, >4 names, odd dims), run by
    Triton's CPU interpreter so CI checks it without a GPU."""
    code = textwrap.dedent("""
        import torch
        from omni_cache.cache.latent_store import launch_rows, MODE_WRITE, MODE_GATHER
        g = torch.Generator().manual_seed(0)
        N, S = 37, 50
        kinds = [(64, torch.bfloat16), (24, torch.float32), (3, torch.bfloat16),
                 (1100, torch.float32), (5, torch.float32)]
        srcs = [torch.randn(N + 3, d, generator=g).to(dt) for d, dt in kinds]
        dsts = [torch.zeros(S + 1, d, dtype=dt) for d, dt in kinds]
        idx = torch.randperm(S, generator=g)[:N]
        idx[::5] = -1
        launch_rows(MODE_WRITE, idx, N, list(zip(srcs, dsts)))
        valid = idx >= 0
        for s, d in zip(srcs, dsts):
            ref = torch.zeros_like(d)
            ref[idx[valid]] = s[:N][valid]
            assert torch.equal(ref, d)
        q = idx.clamp(min=0).int()
        outs = [torch.empty(N, d, dtype=dt) for d, dt in kinds]
        launch_rows(MODE_GATHER, q, N, list(zip(dsts, outs)))
        for d, o in zip(dsts, outs):
            assert torch.equal(o, d[q.long()])
        print("interpreter ok")
    """)
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "interpreter ok" in res.stdout


# ---- CUDA only -----------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
CUDA_WRITE_CONFIGS = [
    pytest.param(
        "device",
        {"use_triton": True},
        id="device-triton",
        marks=pytest.mark.skipif(not TRITON, reason="triton not importable"),
    ),
    pytest.param("device", {"use_triton": False}, id="device-torch"),
    pytest.param("host", {}, id="host-pipeline"),
    pytest.param("host", {"use_triton": False}, id="host-pipeline-torch"),
    pytest.param("host", {"use_driver": False}, id="host-pipeline-torch-issue"),
]


@cuda_only
@pytest.mark.parametrize("storage,kw", CUDA_WRITE_CONFIGS)
def test_cuda_write_does_not_sync_the_host(storage, kw, store_factory):
    gen = torch.Generator().manual_seed(9)
    store = store_factory("cuda", storage, kw)
    ref = Reference(SPECS)
    batches = [
        (random_slot_mapping(n, gen, device="cuda"), random_latents(n + 3, "cuda", gen)) for n in (64, 64, 200, 64)
    ]
    store.write(*batches[0])  # warm-up: Triton compiles here
    ref.write(batches[0][0], {k: v[:64] for k, v in batches[0][1].items()})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for sm, lat in batches[1:]:
            store.write(sm, lat)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for sm, lat in batches[1:]:
        ref.write(sm, {k: v[: sm.shape[0]] for k, v in lat.items()})
    store.synchronize()
    slots = torch.tensor(sorted(ref.rows["hidden"]), dtype=torch.int64)
    assert_rows_equal(store.gather(slots), ref.gather(slots))


@cuda_only
@pytest.mark.parametrize(
    "use_triton", [pytest.param(True, marks=pytest.mark.skipif(not TRITON, reason="triton not importable")), False]
)
def test_cuda_graph_captured_write(use_triton, store_factory):
    gen = torch.Generator().manual_seed(21)
    store = store_factory("cuda", "device", {"use_triton": use_triton})
    n = 48
    static_sm = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    static_lat = {k: torch.zeros(n + 16, d, dtype=dt, device="cuda") for k, (d, dt) in SPECS.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (compiles the kernel); writes nothing
        store.write(static_sm, static_lat)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.write(static_sm, static_lat)
    ref = Reference(SPECS)
    for _ in range(4):
        sm = random_slot_mapping(n, gen, device="cuda")
        lat = random_latents(n + 16, "cuda", gen)
        static_sm.copy_(sm)
        for k in static_lat:
            static_lat[k].copy_(lat[k])
        graph.replay()
        ref.write(sm, {k: v[:n] for k, v in lat.items()})
    torch.cuda.synchronize()
    slots = torch.tensor(sorted(ref.rows["hidden"]), dtype=torch.int64)
    assert_rows_equal(store.gather(slots), ref.gather(slots))


@cuda_only
@pytest.mark.parametrize("rows", [300, 6000], ids=["small-entry", "split-entry"])
def test_cuda_host_pipeline_overlaps_with_pending_compute(rows):
    """Writes issued while the GPU is still busy (matmuls queued before) must not block the caller,
    and gathers right after must see them: one of older rows (not waiting for the new ones), one of
    the new rows. 6000 rows (> 1 MiB) take the path that copies the slots first."""
    gen = torch.Generator().manual_seed(4)
    num_blocks = 1024
    store = LatentStore(SPECS, num_blocks, BLOCK_SIZE, storage="host", device="cuda", staging_tokens=8192)
    try:
        perm = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)
        old_sm, new_sm = perm[:rows], perm[rows : 2 * rows]
        old = random_latents(rows, "cuda", gen)
        store.write(old_sm.cuda(), old)
        store.synchronize()
        x = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        for _ in range(20):  # keep the GPU busy: the latents below are "computed" after this
            x = x @ x
            x /= x.norm()
        dep = (x[0, 0] * 0).nan_to_num(0)
        new = {k: v + dep.to(v.dtype) for k, v in random_latents(rows, "cuda", gen).items()}
        store.write(new_sm.cuda(), new)
        assert_rows_equal(store.gather(old_sm[::3]), {k: v[::3].cpu() for k, v in old.items()})
        assert_rows_equal(store.gather(new_sm), {k: v.cpu() for k, v in new.items()})
    finally:
        store.close()
