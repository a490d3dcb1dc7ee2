"""The weights lock under forced thread switches: forward threads and writer threads loop
for `--seconds`, the interpreter switching threads every microsecond; each forward checks no
write is in progress, each write that no forward is inside. Prints the counts; any violation
or a thread still running at the end exits 1. CPU only (any host):

    python3 gpu/lock_stress.py [--seconds 30] [--forwards 4] [--writers 2]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from fp8_reload.locks import WeightsLock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--forwards", type=int, default=4)
    ap.add_argument("--writers", type=int, default=2)
    args = ap.parse_args()
    sys.setswitchinterval(1e-6)
    lock, count = WeightsLock(), threading.Lock()
    now = {"writing": 0, "inside": 0}
    seen = {"forwards": 0, "writes": 0, "forward beside a write": 0, "write beside a forward": 0,
            "held_for_reading wrong": 0, "writes given up": 0}
    stop = time.monotonic() + args.seconds

    def add(key: str, n: int = 1) -> None:
        with count:
            seen[key] += n

    def forward() -> None:
        n = 0
        while time.monotonic() < stop:
            with lock.read():
                with count:
                    now["inside"] += 1
                if now["writing"]:
                    add("forward beside a write")
                if not lock.held_for_reading:
                    add("held_for_reading wrong")
                with count:
                    now["inside"] -= 1
            if lock.held_for_reading:
                add("held_for_reading wrong")
            n += 1
        add("forwards", n)

    def write() -> None:
        n = 0
        while time.monotonic() < stop:
            hold = lock.commit_hold()
            with hold:
                try:
                    hold.take()
                except RuntimeError:
                    add("writes given up")
                    continue
                with count:
                    now["writing"] += 1
                if now["inside"] or now["writing"] != 1:
                    add("write beside a forward")
                with count:
                    now["writing"] -= 1
            n += 1
        add("writes", n)

    threads = ([threading.Thread(target=forward) for _ in range(args.forwards)]
               + [threading.Thread(target=write) for _ in range(args.writers)])
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + 60)
    alive = sum(t.is_alive() for t in threads)
    print(f"[lock stress] {args.seconds:g} s, {args.forwards} forward and {args.writers} writer threads, "
          f"switch interval 1 us: " + ", ".join(f"{k} {v:,}" for k, v in seen.items())
          + f", threads still running {alive}; afterwards readers {lock.readers}, writing {lock.writing}")
    bad = ("forward beside a write", "write beside a forward", "held_for_reading wrong")
    sys.exit(1 if alive or any(seen[k] for k in bad) else 0)


if __name__ == "__main__":
    main()
