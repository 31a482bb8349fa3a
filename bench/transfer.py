"""KV transfer bandwidth and latency between two processes, against a plain
memcpy of the same bytes, measured in one run.

    python bench/transfer.py [--device cpu|cuda] [--min-mb 1] [--max-mb 256] [--factor 4] [--repeats 7]

This process holds a PairGroupSender, a spawned child a PairGroupReceiver (gloo
for cpu; NCCL for cuda, which needs two GPUs: sender on cuda:0, receiver on
cuda:1). For each size (--min-mb to --max-mb, times --factor) the child posts
its expect(), then the time from send() to the sender's poll() saying DONE is
measured (DONE means the receiver has acknowledged the bytes, so this is end to
end); one warm-up transfer per size is not counted. The memcpy baseline is
`dst.copy_(src)` of the same number of bytes in this process, on one thread by
default (--memcpy-threads): a copy is one thread's work, as is each side of a
pair, and a thread pool on a loaded machine mostly measures its wake-ups. Also
reported: the first transfer on a fresh pair (connecting included) and a 4 KiB
transfer.

Figures move with whatever else the machine runs: use a quiet machine, and
compare ratios from one run rather than figures across runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from pathlib import Path

import torch

from cluster.transport.kv_transport import TransferState
from cluster.transport.pair_group_receiver import PairGroupReceiver
from cluster.transport.pair_group_sender import PairGroupSender

MiB = 1 << 20
POLL_S = 50e-6   # the sender's poll period: an engine loop polls between steps, not in a tight spin


def receiver_main(conn, device: str, timeout_s: float) -> None:
    """Child: answers ("expect", tid, sender, nbytes) by posting a receive; "exit" ends."""
    receiver = PairGroupReceiver(device=device, timeout_s=timeout_s)
    conn.send(receiver.address)
    buffers: dict[int, torch.Tensor] = {}
    last: tuple[str, str] | None = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            receiver.close()
            conn.send("bye")
            return
        tid, sender, nbytes = args
        if last is not None:
            receiver.forget(*last)
        if nbytes not in buffers:
            buffers[nbytes] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        receiver.expect(tid, sender, buffers[nbytes])
        last = (tid, sender)
        conn.send("ready")


def timed_transfer(sender: PairGroupSender, conn, address, tid: str, data: torch.Tensor) -> float:
    """Seconds from send() to DONE; the receive is posted before the clock starts."""
    conn.send(("expect", tid, sender.name, data.numel()))
    if not conn.poll(60) or conn.recv() != "ready":
        raise RuntimeError("the receiver process did not answer")
    start = time.perf_counter()
    sender.send(tid, address, data)
    while not (state := sender.poll(tid)).is_final:
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - start
    if state is not TransferState.DONE:
        raise RuntimeError(sender.error(tid))
    sender.forget(tid)
    return elapsed


def memcpy_s(nbytes: int, device: str, repeats: int, threads: int) -> list[float]:
    torch.set_num_threads(threads)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):   # the first one is a warm-up (page faults on dst)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--min-mb", type=int, default=1)
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--factor", type=int, default=4, help="size step (2 or 4)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--memcpy-threads", type=int, default=1, help="torch threads for the memcpy baseline")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--json", default=None, help="default: bench/results/transfer_<device>.json")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs (NCCL refuses two ranks on one device)")
    send_device, recv_device = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    sizes = []
    mb = args.min_mb
    while mb <= args.max_mb:
        sizes.append(mb * MiB)
        mb *= args.factor

    machine = (f"{platform.machine()}, {multiprocessing.cpu_count()} cores, torch {torch.__version__}, "
               f"memcpy on {args.memcpy_threads} thread(s)")
    print(f"{args.device}: {machine}; median of {args.repeats} after one warm-up (use a quiet machine)")
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver_main, args=(child_conn, recv_device, args.timeout_s), daemon=True)
    child.start()
    sender = PairGroupSender(device=send_device, timeout_s=args.timeout_s)
    rows = []
    try:
        if not conn.poll(120):
            raise RuntimeError("the receiver process did not start")
        address = conn.recv()
        small = torch.zeros(4096, dtype=torch.uint8, device=send_device)
        first_ms = timed_transfer(sender, conn, address, "first", small) * 1e3
        small_ms = statistics.median(timed_transfer(sender, conn, address, f"small-{i}", small)
                                     for i in range(args.repeats)) * 1e3
        print(f"first transfer on a new pair (connecting included): {first_ms:.1f} ms; "
              f"4 KiB transfer: {small_ms:.2f} ms median")
        print(f"{'size MiB':>9} {'median ms':>10} {'min ms':>8} {'GiB/s':>7} {'memcpy GiB/s':>13} {'ratio':>6}")
        for nbytes in sizes:
            data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=send_device)
            timed_transfer(sender, conn, address, f"warm-{nbytes}", data)
            times = [timed_transfer(sender, conn, address, f"{nbytes}-{i}", data) for i in range(args.repeats)]
            copy = statistics.median(memcpy_s(nbytes, send_device, args.repeats, args.memcpy_threads))
            med = statistics.median(times)
            row = {"bytes": nbytes, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                   "gib_s": nbytes / med / 2**30, "memcpy_gib_s": nbytes / copy / 2**30}
            row["ratio_to_memcpy"] = row["gib_s"] / row["memcpy_gib_s"]
            rows.append(row)
            print(f"{nbytes / MiB:9.0f} {row['median_ms']:10.2f} {row['min_ms']:8.2f} {row['gib_s']:7.2f} "
                  f"{row['memcpy_gib_s']:13.2f} {row['ratio_to_memcpy']:6.2f}")
        conn.send(("exit",))
        conn.poll(10)
    finally:
        sender.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)
    out = Path(args.json or Path(__file__).parent / "results" / f"transfer_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "machine": machine, "repeats": args.repeats,
                               "poll_period_s": POLL_S,
                               "first_transfer_ms": first_ms, "small_4kib_ms": small_ms, "sizes": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
