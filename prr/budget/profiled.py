"""`profiled`: one rule, whichever engine runs it (the eager research runtime or the
CUDA-graph engine; each measures with its own probe, on its own step).

Once per device, shape and setting, at each profiled context c:
  1. time T_select(c) and T_speculate(|P|) for |P| = ratio x |A| over `ratios`;
  2. n(c) = the largest |P| with T_speculate(|P|) <= T_select(c): speculation that hides
     inside selection (the paper's rule); 0 where none does;
  3. with `stage_check` (default), time the whole attention stage as serial DSA and as PRR
     at every profiled |P| (up to the context), P holding `hit_rate` of A, and take the
     fastest PRR if it measured faster than serial by more than `margin`; else |P| = 0 (plain
     serial DSA). The stage is what decides, not step 2: hiding speculation is not enough when
     repair and merge cost more than it saves (and a wider P costs the merge more: the largest
     |P| that hides is not always the fastest), and speculation a little longer than selection
     can still win where the attention it takes off the step is large (fp32 Quest at 32K,
     block 16, on an H200: speculation 15.8 µs against selection 14.9 µs, the PRR stage 0.67x
     serial's at 100% hits); a runtime that runs its stages one after the other (the eager
     one) never overlaps them, so there the check chooses serial DSA. `stage_check=false`
     keeps the paper's rule alone (step 2). `hit_rate` is an assumption about the predictor;
     a benchmark predictor that declares its own (bench_hit_rate) must be run with the same
     (config_check says so).
The table (context -> |P|) is cached in a file keyed by device, probe, shape and these
settings; decoding uses the row of the largest profiled context not above the step's context.
The graph engine profiles the prompt's context only (its |P| is static for the decode).

A probe whose runtime runs its stages one after the other (`stages_in_sequence`: the eager
runtime) is not timed at all when `stage_check` is on: |P| = 0 everywhere, said in one line.

A loaded machine times wrongly (issue 23: selection 60 ms under load, 0.36 ms in the run),
so every stage's min/quartiles/max over its repeats are kept; when a stage's upper quartile
is more than `max_spread` × its lower quartile, the whole profile is measured again (up to
`max_rounds`) and the steadiest round kept. A table still that noisy is used but not cached. Each run
says in one console line, and in its summary's budget_setup, what |P| it chose per context
and whether the table was measured now or loaded (which file, how old); and, once decoding
has run a few steps, one warning if selection runs more than 2x off the profiled time.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prr.budget.base import SpeculationBudget, StageTiming, TimingProbe
from prr.paths import cache_dir, write_json_atomic
from prr.progress import progress_bar

if TYPE_CHECKING:
    from prr.step_record import LayerStepRecord

log = logging.getLogger("prr")

# Observed T_select off the profile by more than this factor, median over this many layer
# steps (the first steps alone are noisy), is reported as a contradiction.
CONTRADICTION_FACTOR = 2.0
CONTRADICTION_SAMPLES = 8
CACHE_KEYS = ("key", "device", "table", "measurements", "spread", "rounds", "kept_round")


class ProfiledBudget(SpeculationBudget):
    def __init__(
        self,
        ratios: Sequence[float] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
        context_points: int = 6,
        use_cache: bool = True,
        max_spread: float = 2.0,
        max_rounds: int = 3,
        stage_check: bool = True,
        margin: float = 0.02,
        hit_rate: float = 0.9,
    ) -> None:
        if not ratios or any(r <= 0 for r in ratios):
            raise ValueError(f"budget.ratios={list(ratios)} must be a non-empty list of positive multiples of top-K")
        if context_points < 1:
            raise ValueError(f"budget.context_points={context_points} must be >= 1")
        if max_spread < 1.0:
            raise ValueError(f"budget.max_spread={max_spread} must be >= 1 (the allowed q3/q1 ratio of a stage's repeats)")
        if max_rounds < 1:
            raise ValueError(f"budget.max_rounds={max_rounds} must be >= 1")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"budget.margin={margin} must lie in [0, 1) (PRR's stage must beat serial's by this share)")
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"budget.hit_rate={hit_rate} must lie in [0, 1] (the share of A the stage check's P holds)")
        self.ratios = sorted(ratios)
        self.context_points = context_points
        self.use_cache = use_cache
        self.max_spread, self.max_rounds = max_spread, max_rounds
        self.stage_check, self.margin, self.hit_rate = stage_check, margin, hit_rate
        self.table: list[tuple[int, int]] = []  # (context_blocks, |P|), ascending context
        self.profiled_select: list[tuple[int, float]] = []  # (context_blocks, median T_select s), ascending
        self.context_seen: dict[int, int] = {}  # layer -> context_blocks of its current step
        self.select_ratios: list[float] = []  # observed / profiled T_select, one per layer step
        self.observed_select_ratio: float | None = None  # decided once, after CONTRADICTION_SAMPLES
        self.contradiction: str | None = None  # the one warning, when the run's timings disagree
        # The dict setup() returned (the run's summary.json budget_setup, written after decoding):
        # observe() adds the run's check of the profile to it.
        self.setup_info: dict[str, Any] = {}

    def config_problems(self, selector: Any, predictor: Any, model: Any, predictor_name: str) -> list[str]:
        problems = []
        layers = model.num_layers
        if all(0 <= x < layers for x in selector.dense_layers) and set(range(layers)) <= set(selector.dense_layers):
            problems.append(f"selector.dense_layers={sorted(selector.dense_layers)} makes every layer of the model "
                            f"({layers}) dense: budget=profiled has no selection to time; use budget=fixed or fewer "
                            "dense_layers")
        if not predictor.uses_budget:
            problems.append(f"predictor={predictor_name} sets |P| itself (P = A) and ignores the budget, but "
                            "budget=profiled would size P from timings (the eager runtime speculated on its |P| = 0: "
                            "a hit rate of 0); use budget=fixed")
        declared = predictor.declared_hit_rate
        if declared is not None and self.stage_check and self.hit_rate != declared:
            problems.append(f"budget=profiled checks PRR's stage with P holding budget.hit_rate={self.hit_rate} of A, "
                            f"but predictor={predictor_name} holds {declared}: set budget.hit_rate={declared}")
        return problems

    # --- the graph engine: its own stages profiled once, at the first step's context ----------
    def engine_problems(self, speculates: bool, purpose: str, tensor_parallel: int = 1) -> list[str]:
        out = []
        if purpose == "study":
            out.append("the study decode takes a fixed budget (|P| static for the decode); got budget=profiled")
        if tensor_parallel > 1:
            out.append(f"runtime.tensor_parallel={tensor_parallel} with budget=profiled: each rank would decide from "
                       "its own timings; not yet supported (use budget=fixed)")
        return out

    def engine_blocks(self, selected_blocks: int, max_blocks: int) -> int:
        return min(selected_blocks, max_blocks)  # a placeholder: resolve_engine_blocks measures |P|

    def resolve_engine_blocks(self, make_probe: Any, planned: int, selected_blocks: int, max_blocks: int,
                              context_blocks: int) -> tuple[int, dict[str, Any]]:
        probe = make_probe()
        info = self.setup(probe, selected_blocks, max_blocks, contexts=[context_blocks])
        release = getattr(probe, "release", None)
        if release is not None:  # (the probe's engine and cache, before the run builds its own)
            release()
        return self.predicted_blocks(0, context_blocks, selected_blocks), info

    def _contexts(self, selected_blocks: int, max_blocks: int) -> list[int]:
        lo = max(1, min(selected_blocks, max_blocks))
        if self.context_points == 1 or lo == max_blocks:
            return [max_blocks]
        step = (max_blocks / lo) ** (1 / (self.context_points - 1))
        return sorted({min(max_blocks, round(lo * step**i)) for i in range(self.context_points)})

    def setup(self, probe: TimingProbe, selected_blocks: int, max_blocks: int,
              contexts: Sequence[int] | None = None) -> dict[str, Any]:
        """contexts: the context lengths (blocks) to profile; default `context_points` of them
        from |A| to max_blocks, geometrically spaced."""
        contexts = sorted(set(contexts)) if contexts is not None else self._contexts(selected_blocks, max_blocks)
        if not contexts or any(not 0 < c <= max_blocks for c in contexts):
            raise ValueError(f"profiled contexts {list(contexts)} must be non-empty, each in [1, {max_blocks}] blocks")
        if self.stage_check and getattr(probe, "stages_in_sequence", False):
            return self._serial_without_measuring(contexts)
        # (the fastest timed size: tables of the older rules, the largest or the fastest hidden size, are not reused)
        check = (f"stage_check(fastest_timed,margin={self.margin},hit={self.hit_rate})" if self.stage_check
                 else "no_stage_check")
        key = (f"{probe.device_name}|{probe.shape_key}|K={selected_blocks}|N={max_blocks}|r={self.ratios}|"
               f"contexts={contexts}|{check}")
        path = cache_dir() / "budget" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
        cache_problem = None
        if self.use_cache and path.exists():
            record, cache_problem = self._read_cache(path, key)
            if record is not None:
                self._adopt(record)
                age_s = time.time() - path.stat().st_mtime
                info = {"profile_source": "cache", "profile_cached": True, "profile_cache": str(path),
                        "profile_cache_age_s": age_s, **self._summary(record)}
                log.info("budget=profiled: |P| per context %s; loaded from cache %s (measured %s ago, timing spread %.2fx)",
                         self._describe(), path, _age(age_s), record["spread"])
                self.setup_info = info
                return info
            log.warning("budget=profiled: cache file %s is unusable (%s); measuring again", path, cache_problem)

        record = self._measure(probe, key, selected_blocks, contexts)
        self._adopt(record)
        steady = record["spread"] <= self.max_spread
        if not steady:
            log.warning("budget=profiled: stage timings still spread %.2fx (q3/q1 of a stage's repeats, above max_spread=%s) "
                        "after %d rounds; the machine looks loaded, so this |P| choice is used but not cached",
                        record["spread"], self.max_spread, len(record["rounds"]))
        written = self.use_cache and steady
        if written:
            write_json_atomic(path, record)
        info = {"profile_source": "measured", "profile_cached": False, "profile_cache": str(path) if written else None,
                **self._summary(record)}
        if cache_problem is not None:
            info["profile_cache_problem"] = f"{path}: {cache_problem}"
        where = (f"cached to {path}" if written else f"not cached to {path} (budget.use_cache=false)" if not self.use_cache
                 else f"not cached to {path} (timings too spread)")
        log.info("budget=profiled: |P| per context %s; measured now (%d round(s), timing spread %.2fx), %s",
                 self._describe(), len(record["rounds"]), record["spread"], where)
        self.setup_info = info
        return info

    def _serial_without_measuring(self, contexts: list[int]) -> dict[str, Any]:
        """|P| = 0 at every context, unmeasured: the probe's runtime runs speculate, select,
        repair and merge one after the other (the eager runtime), so PRR's stage is serial
        DSA's plus work and the stage check could only choose serial DSA."""
        self.table = [(c, 0) for c in contexts]
        self.profiled_select = []  # no timings: observe() has nothing to compare
        reason = ("this runtime runs its stages one after another (the eager runtime), so PRR's stage is serial "
                  "DSA's plus speculation and the stage check would choose serial DSA")
        log.info("budget=profiled: |P| = 0 (serial DSA) at every context, not measured: %s; nothing timed or cached "
                 "(budget.stage_check=false times the paper's rule alone)", reason)
        self.setup_info = {"profile_source": "not measured", "profile_cached": False, "profile_cache": None,
                           "profile_reason": reason, "profile_table": self.table,
                           "profile_choice": {str(c): 0 for c in contexts}}
        return self.setup_info

    def _measure(self, probe: TimingProbe, key: str, selected_blocks: int, contexts: list[int]) -> dict[str, Any]:
        """Rounds of the whole profile until one is steady (or max_rounds); the steadiest is kept."""
        sizes = sorted({max(1, round(r * selected_blocks)) for r in self.ratios})
        rounds = []
        for i in range(self.max_rounds):
            points = len(contexts) * (1 + len(sizes) + (1 + len(sizes) if self.stage_check else 0))
            with progress_bar(points, f"budget=profiled: timing, round {i + 1} "
                              f"(of at most {self.max_rounds})", "point") as bar:
                rounds.append(self._measure_round(probe, contexts, sizes, bar.update))
            if rounds[-1]["spread"] <= self.max_spread:
                break
        kept = min(range(len(rounds)), key=lambda i: rounds[i]["spread"])
        return {"key": key, "device": probe.device_name, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "table": rounds[kept]["table"], "measurements": rounds[kept]["measurements"],
                "spread": rounds[kept]["spread"], "rounds": [r["spread"] for r in rounds], "kept_round": kept}

    def _measure_round(self, probe: TimingProbe, contexts: list[int], sizes: list[int],
                       tick: Callable[[int], Any] = lambda n: None) -> dict[str, Any]:
        """tick(n): n more timing points done (a progress bar's update)."""
        t_select: dict[int, StageTiming] = {}
        for c in contexts:
            t_select[c] = probe.time_select(c)
            tick(1)
        rows: list[dict[str, Any]] = []
        table = []
        spreads = []
        for c in contexts:
            t_spec = {}
            for n in sizes:
                t_spec[n] = probe.time_speculate(min(n, c), c)
                tick(1)
            fitting = [n for n in sizes if n <= c and t_spec[n].median_s <= t_select[c].median_s]
            hidden = max(fitting) if fitting else 0
            spreads += [t_select[c].spread, *(t.spread for t in t_spec.values())]
            row = {"context_blocks": c, "t_select_s": t_select[c].median_s,
                   "t_speculate_s": {n: t.median_s for n, t in t_spec.items()},
                   "select_timing": t_select[c].as_dict(),
                   "speculate_timing": {n: t.as_dict() for n, t in t_spec.items()}, "hidden_blocks": hidden}
            # step 3: the whole stage decides, at every size up to the context, hidden or not
            chosen = 0 if self.stage_check else hidden
            timed = [n for n in sizes if n <= c] if self.stage_check else []
            if timed:
                serial = probe.time_stage(c, 0, self.hit_rate)
                prr = {n: probe.time_stage(c, n, self.hit_rate) for n in timed}
                spreads += [serial.spread, *(t.spread for t in prr.values())]
                best = min(timed, key=lambda n: (prr[n].median_s, -n))  # (a tie: the wider P)
                faster = prr[best].median_s < serial.median_s * (1.0 - self.margin)
                chosen = best if faster else 0
                row.update(stage_serial_s=serial.median_s, stage_best_blocks=best, stage_prr_s=prr[best].median_s,
                           stage_prr_by_size_s={n: t.median_s for n, t in prr.items()},
                           stage_serial_timing=serial.as_dict(), stage_prr_timing=prr[best].as_dict())
            tick(1 + len(sizes) if self.stage_check else 0)  # the stage check's points
            table.append((c, chosen))
            rows.append(row)
        return {"table": table, "measurements": rows, "spread": max(spreads)}

    @staticmethod
    def _read_cache(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
        """(record, None) for a usable cache file, else (None, what is wrong with it)."""
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return None, f"cannot read it as JSON: {err}"
        if not isinstance(record, dict):
            return None, f"holds a {type(record).__name__}, not an object"
        missing = [k for k in CACHE_KEYS if k not in record]
        if missing:
            return None, f"missing keys {missing} (written by an older prr, or damaged)"
        if record["key"] != key:
            return None, f"key {record['key']!r} is not this run's {key!r}"
        table = record["table"]
        if (not isinstance(table, list) or not table
                or not all(isinstance(row, list) and len(row) == 2 and all(isinstance(v, int) and v >= 0 for v in row)
                           for row in table)
                or [c for c, _ in table] != sorted({c for c, _ in table})):
            return None, f"table {table!r} is not a list of [context_blocks, |P|] pairs of ints, ascending context"
        rows = record["measurements"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("context_blocks"), int)
                                                 and isinstance(r.get("t_select_s"), (int, float)) for r in rows):
            return None, "measurements are not rows with context_blocks and t_select_s"
        if not isinstance(record["spread"], (int, float)):
            return None, f"spread {record['spread']!r} is not a number"
        return record, None

    def _adopt(self, record: dict[str, Any]) -> None:
        self.table = [(c, n) for c, n in record["table"]]
        self.profiled_select = [(row["context_blocks"], row["t_select_s"]) for row in record["measurements"]]

    @staticmethod
    def _summary(record: dict[str, Any]) -> dict[str, Any]:
        return {"profile_key": record["key"], "profile_table": record["table"],
                "profile_choice": {str(c): n for c, n in record["table"]},  # context_blocks -> |P|
                "profile_spread": record["spread"], "profile_rounds": record["rounds"],
                "profile_kept_round": record["kept_round"], "profile_measurements": record["measurements"]}

    def _describe(self) -> str:
        return ", ".join(f"{c} blocks -> {n}" for c, n in self.table)

    def predicted_blocks(self, layer: int, context_blocks: int, selected_blocks: int) -> int:
        if not self.table:
            raise RuntimeError("budget=profiled was not set up; the runtime calls setup(probe) before decoding")
        contexts = [c for c, _ in self.table]
        # The largest profiled context not above this one (the first one below the grid).
        i = max(0, bisect.bisect_right(contexts, context_blocks) - 1)
        self.context_seen[layer] = context_blocks
        return min(self.table[i][1], context_blocks)

    def expected_select_s(self, context_blocks: int) -> float:
        """The profiled T_select at this context: linear between grid points, flat outside."""
        contexts = [c for c, _ in self.profiled_select]
        i = bisect.bisect_right(contexts, context_blocks)
        if i == 0 or i == len(contexts):
            return self.profiled_select[max(0, i - 1)][1]
        (c0, t0), (c1, t1) = self.profiled_select[i - 1], self.profiled_select[i]
        return t0 + (t1 - t0) * (context_blocks - c0) / (c1 - c0)

    def observe(self, records: Iterable[LayerStepRecord]) -> None:
        """Compare the run's selection times with the profile's: a table measured under other
        load (issue 23: 60 ms profiled, 0.36 ms in the run) chose the wrong |P|; say so once."""
        if self.observed_select_ratio is not None or not self.profiled_select:
            return
        for r in records:
            if r.step == 0:  # the first decode step pays one-off warm-up costs
                continue
            expected = self.expected_select_s(self.context_seen[r.layer])  # set by predicted_blocks this step
            if "select" in r.timings and expected > 0:
                self.select_ratios.append(r.timings["select"] / expected)
        if len(self.select_ratios) < CONTRADICTION_SAMPLES:
            return
        ratio = self.observed_select_ratio = statistics.median(self.select_ratios)
        self.setup_info["observed_select_ratio"] = ratio  # observed / profiled T_select in this run
        if not 1 / CONTRADICTION_FACTOR <= ratio <= CONTRADICTION_FACTOR:
            self.contradiction = (f"budget=profiled: selection in this run takes {ratio:.2f}x the profiled time (median "
                                  f"over {len(self.select_ratios)} layer steps); the profile was timed under other load than this run, "
                                  "so its |P| choice is likely wrong: delete the cache file or set budget.use_cache=false")
            log.warning(self.contradiction)
            self.setup_info["profile_contradiction"] = self.contradiction


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
