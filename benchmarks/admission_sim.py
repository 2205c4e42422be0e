"""How many decode steps an offline run of identical requests takes under an admission plan,
and what they cost: a step-cost model fitted to a scheduler log, not the engine.

    python3 benchmarks/admission_sim.py --capacity 1741507 --fit-log offline_kv8.log
    python3 benchmarks/admission_sim.py --capacity 870753 --cost 3.95e-3 19.1e-6 30.2e-9 --search

Every request holds its prompt plus one token per step it has decoded; it is admitted only
when the pool, with the requests already running, can hold it until it finishes (the
scheduler's peak check). A decode step costs `fixed + per_request * batch + per_token *
context tokens` (fitted by least squares to the log's decode lines that follow a decode line:
with FP8 KV on the H200, 3.2 ms + 22 us + 18.1 ns; bf16, 3.95 ms + 19.1 us + 30.2 ns). The
batch and token terms add up to the same total under any plan, so a plan saves only through
the number of steps, each of which reads the weights once.

Plans:
- greedy: admit every request that fits, at once (what the scheduler does). Identical requests
  then run in synchronised cohorts: with 1,000 x 1024/1024 and room for 850 at their peak,
  850 for 1,023 steps, then 150 alone for 1,023 more.
- remainder first: the first cohort is the requests a whole number of full cohorts leaves
  over (N mod C), then only whole cohorts (min(queue, C)) and only once they fit: the small
  cohort finishes while the big one grows, so the big one starts ~360 steps in, not 1,023.
- hold (--search): n0 requests at step 0, none until step d, then greedy; the grid's best.
Prefill time is left out: it is the same under every plan (the same prompts), though a real
run interleaves it with the decode steps differently.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

# decode lines of the scheduler log: running requests, tokens held, generation throughput
DECODE_LINE = re.compile(r"Decode batch\. #running-req: (\d+), #token: (\d+), .*"
                         r"gen throughput \(token/s\): ([\d.]+)")


@dataclass(frozen=True)
class StepCost:
    fixed: float  # seconds per decode step
    per_request: float  # seconds per running request
    per_token: float  # seconds per context token held

    def seconds(self, batch: int, tokens: int) -> float:
        return self.fixed + self.per_request * batch + self.per_token * tokens


def fit_step_cost(lines: list[str]) -> StepCost:
    """Least squares over the decode lines whose interval held no prefill (a decode line right
    after a decode line): step seconds = batch / throughput."""
    rows = []
    previous_was_decode = False
    for line in lines:
        match = DECODE_LINE.search(line)
        if match:
            if previous_was_decode:
                batch, tokens, rate = int(match[1]), int(match[2]), float(match[3])
                rows.append((batch, tokens, batch / rate))
            previous_was_decode = True
        elif "Prefill batch" in line:
            previous_was_decode = False
    if len(rows) < 3:
        raise ValueError(f"{len(rows)} decode-only intervals in the log: too few to fit")
    design = np.array([[1.0, batch, tokens] for batch, tokens, _ in rows])
    seconds = np.array([step for *_, step in rows])
    fixed, per_request, per_token = np.linalg.lstsq(design, seconds, rcond=None)[0]
    return StepCost(float(fixed), float(per_request), float(per_token))


@dataclass(frozen=True)
class Workload:
    requests: int
    input_len: int
    output_len: int
    capacity: int  # KV pool tokens

    @property
    def steps_per_request(self) -> int:  # decode steps: prefill made the first token
        return self.output_len - 1

    @property
    def full_cohort(self) -> int:  # requests that fit together at their peak
        return self.capacity // (self.input_len + self.steps_per_request)


Groups = dict[int, int]  # start step -> requests started then
Plan = Callable[[Workload, int, Groups, int], int]  # (workload, step, running, queued) -> admit


def fits(work: Workload, step: int, groups: Groups, extra: int) -> bool:
    """Can `extra` more requests start at `step` with the running ones, at every future step?
    Usage only grows between finishes, so its peaks are just before each group finishes."""
    live = dict(groups)
    if extra:
        live[step] = live.get(step, 0) + extra
    life = work.steps_per_request
    for end_start in live:
        moment = end_start + life - 1
        used = sum(count * (work.input_len + moment - start) for start, count in live.items()
                   if start + life > moment)
        if used > work.capacity:
            return False
    return True


def most_that_fit(work: Workload, step: int, groups: Groups, queued: int) -> int:
    low, high = 0, queued
    while low < high:
        middle = (low + high + 1) // 2
        if fits(work, step, groups, middle):
            low = middle
        else:
            high = middle - 1
    return low


def greedy(work: Workload, step: int, groups: Groups, queued: int) -> int:
    return most_that_fit(work, step, groups, queued)


def remainder_first(work: Workload, step: int, groups: Groups, queued: int) -> int:
    whole = work.full_cohort
    if step == 0 and work.requests % whole:
        return min(work.requests % whole, most_that_fit(work, step, groups, queued))
    want = min(queued, whole)
    return want if fits(work, step, groups, want) else 0


def hold(first: int, delay: int) -> Plan:
    def plan(work: Workload, step: int, groups: Groups, queued: int) -> int:
        if step == 0:
            return min(first, most_that_fit(work, step, groups, queued))
        return 0 if step < delay else most_that_fit(work, step, groups, queued)
    return plan


@dataclass
class Outcome:
    steps: int
    decode_seconds: float
    cohorts: list[tuple[int, int]]  # (start step, requests)


def simulate(work: Workload, plan: Plan, cost: StepCost) -> Outcome:
    groups: Groups = {}
    queued, step, steps, seconds = work.requests, 0, 0, 0.0
    cohorts: list[tuple[int, int]] = []
    while queued or groups:
        if queued:
            admitted = plan(work, step, groups, queued)
            if admitted:
                groups[step] = groups.get(step, 0) + admitted
                queued -= admitted
                cohorts.append((step, admitted))
        if groups:
            batch = sum(groups.values())
            tokens = sum(count * (work.input_len + step - start)
                         for start, count in groups.items())
            seconds += cost.seconds(batch, tokens)
            steps += 1
        step += 1
        groups = {start: count for start, count in groups.items()
                  if step - start < work.steps_per_request}
        if not groups and queued and step > 10 * work.steps_per_request:
            raise ValueError("the plan admits nothing while the pool is empty")
    return Outcome(steps, seconds, cohorts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, required=True, help="KV pool tokens")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--fit-log", type=Path, help="a scheduler log to fit the step cost to")
    source.add_argument("--cost", type=float, nargs=3, metavar=("FIXED", "PER_REQ", "PER_TOK"))
    parser.add_argument("--search", action="store_true",
                        help="also the best hold(n0, d) plan on a grid (a few minutes)")
    args = parser.parse_args()
    cost = (fit_step_cost(args.fit_log.read_text().splitlines()) if args.fit_log
            else StepCost(*args.cost))
    work = Workload(args.requests, args.input_len, args.output_len, args.capacity)
    print(f"step cost {cost.fixed * 1e3:.2f} ms + {cost.per_request * 1e6:.1f} us/request + "
          f"{cost.per_token * 1e9:.1f} ns/token; full cohort {work.full_cohort} requests")
    plans: list[tuple[str, Plan]] = [("greedy", greedy), ("remainder first", remainder_first)]
    if args.search:
        grid = [(first, delay) for first in range(50, work.full_cohort + 1, 50)
                for delay in range(60, work.steps_per_request, 60)]
        best = min(grid, key=lambda fd: simulate(work, hold(*fd), cost).decode_seconds)
        plans.append((f"hold({best[0]}, {best[1]})", hold(*best)))
    for name, plan in plans:
        outcome = simulate(work, plan, cost)
        print(f"{name:>18}: {outcome.steps:5d} steps, decode {outcome.decode_seconds:6.2f} s, "
              f"cohorts (step, requests) {outcome.cohorts[:6]}")


if __name__ == "__main__":
    main()
