"""The engine process's link under load and failure (tokenyard/engines/serving/engine_process.py), with the
mock engine in the child: one frame per loop turn, a bound on adds in flight, and a child killed with
SIGKILL mid-run (requests without a token yet are sent again and finish whole; streaming ones end with
an error; no token is lost or sent twice); a worker link that stops reading a shared core is dropped
and never stalls the others; with the demo model, LoRA adapters loaded and unloaded at run
time are replayed on the fresh core before the kept requests reach it."""
from __future__ import annotations

import asyncio
import json
import os
import signal

from engine_process_helpers import collect, recipe
from gateway_helpers import ROOT

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.serving.engine_core import connect_core, reap, start_listening_core
from tokenyard.engines.serving.engine_link import _HEADER, _Link
from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe

LORA = ROOT / "tokenyard" / "models" / "demo-large-lora"


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def count_writes(ep: EngineProcess) -> list[bytes]:
    writes: list[bytes] = []
    write = ep._writer.write

    def counted(data: bytes) -> None:
        writes.append(data)
        write(data)
    ep._writer.write = counted
    return writes


def test_adds_and_aborts_of_one_loop_turn_go_as_one_frame_and_a_step_comes_back_as_one():
    async def main():
        ep = EngineProcess(recipe(token_ms=2, output_len=1000), "m")
        await ep.start()
        writes = count_writes(ep)
        delivered: list[int] = []
        deliver = ep._deliver
        ep._deliver = lambda outs: (delivered.append(len(outs)), deliver(outs))
        streams = [ep.add_request(f"r{i}", [1, 2, 3], {"max_tokens": 5}) for i in range(12)]
        ep.abort("r11")
        await asyncio.sleep(0)             # the loop turn ends: its messages leave together
        assert len(writes) == 1
        (n,) = _HEADER.unpack(writes[0][:_HEADER.size])
        assert len(writes[0]) == _HEADER.size + n          # one frame holding 11 adds and an abort
        results = [await collect(s) for s in streams]
        assert all(len(tokens(r)) == 5 for r in results[:11]) and results[11][-1].finish_reason == "abort"
        assert max(delivered) >= 11        # one step's outputs for all of them arrived in one frame
        assert len(writes) == 1            # nothing else was sent while they ran
        await ep.stop()

    asyncio.run(main())


def test_adds_beyond_the_bound_wait_in_the_parent_and_go_as_the_core_takes_earlier_ones():
    async def main():
        ep = EngineProcess(recipe(token_ms=1, output_len=1000), "m", max_outstanding_adds=2)
        await ep.start()
        streams = [ep.add_request(f"r{i}", [1, 2, 3], {"max_tokens": 3 + i}) for i in range(6)]
        assert ep.num_held == 4 and ep._unacked == 2       # the loop never waits: the rest is held here
        ep.abort("r5")                                     # held: it never reaches the core
        assert ep.num_held == 3
        results = [await collect(s) for s in streams]
        assert [len(tokens(r)) for r in results[:5]] == [3, 4, 5, 6, 7]
        assert results[5][-1].finish_reason == "abort" and tokens(results[5]) == []
        assert ep.num_held == 0 and ep._unacked == 0
        await ep.stop()

    asyncio.run(main())


def test_sigkill_mid_run_sends_waiting_requests_again_and_ends_streaming_ones_with_an_error():
    async def main():
        # max_num_seqs 2: two requests stream while the other three wait in the engine without a token
        ep = EngineProcess(recipe(token_ms=25, output_len=1000, max_num_seqs=2), "m", restart_backoff_s=0.01)
        await ep.start()
        want = tokens(await collect(ep.add_request("ref", [1, 2, 3], {"max_tokens": 8})))
        assert len(want) == 8
        streams = {rid: ep.add_request(rid, [1, 2, 3], {"max_tokens": 8}) for rid in "abcde"}
        first = await asyncio.wait_for(streams["a"].get(), 10)
        assert first.new_token_ids
        old = ep.pid
        os.kill(old, signal.SIGKILL)
        results = {rid: await collect(s, 30) for rid, s in streams.items()}
        results["a"].insert(0, first)
        for rid in "ab":           # streaming when the child died: what they got stands, then an error
            got = tokens(results[rid])
            assert results[rid][-1].finish_reason == "error" and "restarted" in results[rid][-1].error
            assert 1 <= len(got) < 8 and got == want[:len(got)]
        for rid in "cde":          # no token yet: sent again, served whole, nothing twice
            assert results[rid][-1].finish_reason == "length", results[rid][-1]
            assert tokens(results[rid]) == want
        assert ep.num_restarts == 1 and ep.num_resubmitted == 3 and ep.pid != old
        assert ep.num_in_flight == 0
        await ep.stop()

    asyncio.run(main())


def test_a_request_that_keeps_killing_its_core_is_failed_after_max_resubmits():
    async def main():
        ep = EngineProcess(recipe(ttft_ms=60_000), "m", restart_backoff_s=0.01, max_resubmits=1)
        await ep.start()
        stream = ep.add_request("poison", [1, 2, 3], {"max_tokens": 4})
        for kill in range(2):
            while ep._writer is None or ep._unacked or ep.dead:     # the (fresh) core took it
                await asyncio.sleep(0.01)
            os.kill(ep.pid, signal.SIGKILL)
            while ep.num_restarts < kill + 1:
                await asyncio.sleep(0.01)
        outs = await collect(stream, 30)
        assert outs[-1].finish_reason == "error" and tokens(outs) == [] and ep.num_resubmitted == 1
        await ep.stop()

    asyncio.run(main())


def test_run_time_adapter_loads_and_unloads_are_replayed_on_a_core_killed_with_sigkill():
    """demo-large with `add` from the deployment: `rev` (the committed reverse adapter) is loaded and `add`
    unloaded at run time. A request for `rev` waits in the core (max_num_seqs 1, a long base request runs)
    when the core is killed: it is sent again to the fresh core after the replay and gives the tokens it
    gave before the crash; `add` stays unloaded."""
    prompt = [1956, *range(300, 316)]
    greedy = {"temperature": 0.0, "ignore_eos": True}

    async def main():
        ep = EngineProcess(EngineRecipe("torch", ROOT / "tokenyard" / "models" / "demo-large", {
            "dtype": "float32", "kv_cache_memory": 8 << 20, "max_num_seqs": 1,
            "lora_modules": {"add": str(LORA / "add")}}), "lora", restart_backoff_s=0.01)
        await ep.start()
        try:
            await ep.load_adapter("rev", str(LORA / "reverse"))
            await ep.unload_adapter("add")
            rev = SamplingParams(max_tokens=8, lora="rev", **greedy)
            want = tokens(await collect(ep.add_request("w", prompt, rev), 60))
            base = tokens(await collect(ep.add_request("b", prompt, SamplingParams(max_tokens=8, **greedy)), 60))
            assert len(want) == 8 and want != base          # the adapter answers, not the base
            blocker = ep.add_request("block", prompt, SamplingParams(max_tokens=400, **greedy))
            assert (await asyncio.wait_for(blocker.get(), 60)).new_token_ids
            kept = ep.add_request("kept", prompt, rev)
            while ep._unacked:                               # the core took it; it waits behind the blocker
                await asyncio.sleep(0.01)
            old = ep.pid
            os.kill(old, signal.SIGKILL)
            outs = await collect(kept, 60)
            assert outs[-1].finish_reason == "length", outs[-1]
            assert tokens(outs) == want                      # served by `rev` on the fresh core
            assert (await collect(blocker, 60))[-1].finish_reason == "error"
            assert ep.num_restarts == 1 and ep.num_resubmitted == 1 and ep.pid != old
            assert ep.stats().lora_names == ["rev"]          # `add` stays unloaded
            gone = await collect(ep.add_request("add", prompt, SamplingParams(max_tokens=4, lora="add", **greedy)), 60)
            assert gone[-1].finish_reason == "error" and gone[-1].bad_request and tokens(gone) == []
        finally:
            await ep.stop()

    asyncio.run(main())


def test_a_worker_link_that_stops_reading_is_dropped_and_never_stalls_the_other_workers(tmp_path):
    """A core shared by two links (server.workers 2), worker_stall_s 1: one link adds 8 long requests and
    then never reads (a worker stopped with SIGSTOP looks the same to the core). The core's frames to it
    fill its socket; the other link's requests still finish within a bound, and the stalled link is
    dropped: its requests are aborted (the engine runs none of them, its blocks are free) and its
    socket closed."""
    path = tmp_path / "core.sock"
    proc = start_listening_core(recipe(token_ms=2, output_len=100_000), "m", path, stall_s=1.0)

    async def main():
        ep = EngineProcess(recipe(), "m", connect=path)
        await ep.start()
        sock, _ = connect_core(path)
        try:
            long = {"max_tokens": 4000, "ignore_eos": True}     # 8 s each at 2 ms a token: they outlive the drop
            _Link(sock).send(("msgs", [("add", f"s{i}", [1, 2, 3], long, 0, None) for i in range(8)]))
            while ep.others_in_flight != 8:
                await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for round_ in range(3):        # before, during and after the stalled link's socket fills
                streams = [ep.add_request(f"r{round_}.{i}", [1, 2, 3], {"max_tokens": 20}) for i in range(4)]
                for st in streams:
                    outs = await collect(st, 5)
                    assert outs[-1].finish_reason == "length" and len(tokens(outs)) == 20
                await asyncio.sleep(0.5)
            while ep.others_in_flight:     # the stalled link's requests left the engine
                assert loop.time() - t0 < 5, ep.others_in_flight
                await asyncio.sleep(0.02)
            assert loop.time() - t0 < 6                           # dropped long before they could finish
            st = ep.stats()
            assert st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks
            sock.settimeout(10)
            while sock.recv(1 << 20):      # what it was sent, then the end: the core closed the link
                pass
            outs = await collect(ep.add_request("after", [1, 2, 3], {"max_tokens": 5}), 5)
            assert len(tokens(outs)) == 5 and ep.num_restarts == 0     # the live link was never touched
        finally:
            sock.close()
            await ep.stop()

    try:
        asyncio.run(main())
    finally:
        proc.terminate()
        reap(proc)


def test_a_shared_core_started_again_gets_its_run_time_adapters_back_from_the_worker_that_changed_them(tmp_path):
    """Two links to one core (server.workers 2), mock engine with `chat` from the deployment: worker a loads
    `sql` and unloads `chat`; the core is killed and started again (as the supervisor does). Both links
    link again; a replays its changes, so worker b, which never loaded `sql`, is served with it, and
    `chat` stays unloaded."""
    folder = tmp_path / "sql"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    path = tmp_path / "core.sock"
    rec = recipe(token_ms=2, output_len=1000, lora_modules={"chat": "unused"})
    procs = [start_listening_core(rec, "m", path)]

    async def main():
        a = EngineProcess(rec, "a", connect=path, restart_backoff_s=0.01)
        b = EngineProcess(rec, "b", connect=path, restart_backoff_s=0.01)
        await a.start()
        await b.start()
        try:
            await a.load_adapter("sql", str(folder))
            await a.unload_adapter("chat")
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait()
            procs.append(await asyncio.to_thread(start_listening_core, rec, "m", path))
            while a.num_restarts < 1 or b.num_restarts < 1 or a.dead or b.dead:
                await asyncio.sleep(0.01)
            outs = await collect(b.add_request("q", [1, 2, 3], SamplingParams(max_tokens=4, lora="sql")), 10)
            assert outs[-1].finish_reason == "length" and len(tokens(outs)) == 4
            assert b.stats().lora_names == ["sql"]
            refused = await collect(b.add_request("c", [1, 2, 3], SamplingParams(max_tokens=4, lora="chat")), 10)
            assert refused[-1].finish_reason == "error" and refused[-1].bad_request
        finally:
            await a.stop()
            await b.stop()

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            proc.terminate()
            reap(proc)
