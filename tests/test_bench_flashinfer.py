"""The CPU-testable parts of experiments/bench_flashinfer.py: arguments, byte floors, tables.
(FlashInfer itself only runs on a GPU; the script imports it and torch inside its GPU functions.)"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_flashinfer", ROOT / "experiments" / "bench_flashinfer.py")
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)


def test_defaults_are_the_issue_grid():
    args = bf.parse_args([])
    assert args.batches == [1, 8] and args.contexts == [32768, 131072] and args.blocks == [16, 64]
    assert args.budgets == [2048, 8192] and args.topk_blocks == [2048, 8192] and args.topk_k == [32, 128]
    assert args.topk_rows == [8, 64] and args.parts == ["attention", "topk", "stage", "prr"]
    quick = bf.parse_args(["--quick", "--blocks", "64"])
    assert quick.batches == [1] and quick.blocks == [64] and quick.budgets == [2048]


@pytest.mark.parametrize("argv, needle", [
    (["--blocks", "24"], "power of two"),
    (["--blocks", "8"], "power of two"),
    (["--budgets", "1000"], "multiple of block size"),
    (["--budgets", "65536", "--contexts", "32768"], "exceeds context"),
    (["--topk-rows", "12"], "multiple of 8"),
    (["--topk-k", "4096", "--topk-blocks", "2048"], "exceeds 2048 blocks"),
    (["--parts", "attention,nope"], "choose from"),
    (["--sets", "0"], "--sets=0"),
    (["--batches", "1,x"], "comma-separated list of integers"),
    (["--batches", "0"], "must be > 0"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        bf.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("bench_flashinfer: error:")


def test_bad_arguments_from_the_command_line():
    """The script itself: exit 2, one line, before torch or a GPU is needed."""
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_flashinfer.py"), "--blocks", "24"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1


def test_byte_floors():
    # batch 1, 2K budget in blocks of 16: K and V of 8 heads x 2048 tokens x 128 x bf16, q and out, 128 ids per head
    kv = 2 * 8 * 2048 * 128 * 2
    assert bf.attention_bytes(1, 2048, 16) == kv + 2 * 32 * 128 * 2 + 8 * 128 * 4
    assert bf.attention_bytes(8, 2048, 64) == 8 * kv + 8 * 2 * 32 * 128 * 2 + 8 * 8 * 32 * 4
    assert bf.topk_bytes(64, 8192, 128) == 64 * 8192 * 4 + 64 * 128 * 4
    meta = 2 * 128 * 2  # Quest key max + min, bf16
    assert bf.stage_bytes(1, 131072, 2048, 16, meta) == 8 * 8192 * meta + bf.attention_bytes(1, 2048, 16)
    assert bf.floor_us(4.8e6, 4.8e12) == pytest.approx(1.0)
    # ~1.95 µs: the batch-1 2K-budget floor the issue quotes, at ~4.3 TB/s measured
    assert 1.8 < bf.floor_us(bf.attention_bytes(1, 2048, 16), 4.3e12) < 2.1


def test_ratios_and_formatting():
    from prr.bench_args import fmt, markdown

    assert bf.ratio(2.0, 4.0) == 0.5
    assert bf.ratio(None, 1.0) is None and bf.ratio(1.0, 0.0) is None and bf.ratio("x", 1.0) is None
    assert fmt(None) == "-" and fmt(float("nan")) == "-" and fmt(True) == "yes" and fmt(False) == "NO"
    assert fmt(1.23456) == "1.23" and fmt(123456.7) == "123457" and fmt("x") == "x"
    assert markdown(["a", "b"], [[1.5, None]]) == "| a | b |\n|---|---|\n| 1.5 | - |"
    assert bf.best_of({"a": 3.0, "b": 2.0, "c": None}, ("a", "b", "c")) == ("b", 2.0)
    assert bf.best_of({"a_error": "x"}, ("a",)) == (None, None)


def test_tables_from_rows():
    att = [dict(batch=1, context=131072, block_size=16, budget_tokens=8192, prr_us=10.0, fi_decode_us=12.0,
                fi_decode_tc_us=11.0, fi_blocksparse_us=25.0, floor_us=5.0, max_abs_prr_vs_fi=0.0039),
           dict(batch=8, context=32768, block_size=64, budget_tokens=2048, prr_us=20.0, fi_decode_tc_us_error="boom",
                error="")]
    table = bf.attention_table(att)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| B | ctx K |")
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[:4] == ["1", "128", "16", "8192"]
    assert first[9] == "0.909"  # prr / the faster FlashInfer decode (tensor cores, 11 µs)
    assert first[10] == "2.5"  # FlashInfer BlockSparse / prr
    assert first[12] == "2" and first[13] == "2.2"  # prr and FlashInfer over the floor
    assert first[14] == "0.0039"
    second = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second[5] == "-" and second[9] == "-" and second[14] == "-"  # nothing to compare with
    assert "2.50-2.50x over 1 cells" in bf.paper_scale(att)
    assert "no 8K-budget cell" in bf.paper_scale(att[1:])

    topk = bf.topk_table([dict(rows=8, blocks=8192, k=32, prr_us=22.0, fi_top_k_us=12.0, fi_page_table_us=11.0,
                               torch_topk_us=30.0, floor_us=1.0, sets_equal=True)])
    cells = [c.strip() for c in topk.splitlines()[2].strip("|").split("|")]
    assert cells[7] == "2" and cells[9] == "yes"

    stage = bf.stage_table([dict(batch=1, context=32768, block_size=16, budget_tokens=2048, prr_serial_us=30.0,
                                 prr_fused_us=24.0, fi_serial_us=25.0, floor_us=4.0, sets_equal=False,
                                 max_abs_prr_vs_fi=0.0)])
    cells = [c.strip() for c in stage.splitlines()[2].strip("|").split("|")]
    assert cells[6] == "-" and cells[7] == "-"  # no split top-k timed
    assert cells[8] == "-" and cells[9] == "-"  # no other radix timed
    assert cells[12] == "1.2" and cells[13] == "0.96" and cells[15] == "6" and cells[17] == "NO"
    split = bf.stage_table([dict(batch=1, context=131072, block_size=16, budget_tokens=2048, prr_serial_us=30.0,
                                 prr_fused_us=34.0, prr_split_us=20.0, prr_split_chunk=1024, fi_serial_us=25.0,
                                 floor_us=4.0, sets_equal=True)])
    cells = [c.strip() for c in split.splitlines()[2].strip("|").split("|")]
    assert cells[6] == "20" and cells[7] == "1024"
    assert cells[12] == "1.2" and cells[13] == "0.8" and cells[15] == "5"  # the best prr is the split stage
    radix = bf.stage_table([dict(batch=1, context=131072, block_size=16, budget_tokens=2048, prr_serial_us=30.0,
                                 prr_radix_us=15.0, prr_radix_bits=1, fi_serial_us=25.0, floor_us=5.0)])
    cells = [c.strip() for c in radix.splitlines()[2].strip("|").split("|")]
    assert cells[8] == "15" and cells[9] == "1" and cells[13] == "0.6" and cells[15] == "3"

    text = bf.report({"command": "python experiments/bench_flashinfer.py --quick", "bandwidth_GBps": 4300.0,
                      "environment": {"gpu": "NVIDIA H200", "flashinfer": "0.6.14"},
                      "attention": att, "topk": [], "stage": []})
    assert "`python experiments/bench_flashinfer.py --quick`" in text and "flashinfer 0.6.14" in text
    assert "## Attention over A" in text and "## Top-k" not in text


def test_report_rewrites_csv_and_markdown_from_a_saved_run(tmp_path):
    record = {"command": "python experiments/bench_flashinfer.py", "bandwidth_GBps": 4218.0,
              "environment": {"gpu": "NVIDIA H200"}, "attention": [], "stage": [],
              "topk": [dict(rows=8, blocks=2048, k=32, prr_us=7.5, fi_top_k_us=9.3, floor_us=0.0158, sets_equal=True)]}
    saved = tmp_path / "run.json"
    saved.write_text(__import__("json").dumps(record))
    bf.main(["--report", str(saved)])
    assert "| 8 | 2048 | 32 | 7.5 | 9.3 |" in (tmp_path / "run.md").read_text()
    assert (tmp_path / "run.csv").read_text().startswith("command,")


def test_topk_split_columns_and_arguments():
    assert bf.parse_args([]).topk_split == [1024, 2048] and bf.parse_args(["--quick"]).topk_split == [1024]
    args = bf.parse_args([])
    args.topk_split = [1000, 8, 1024]
    problems = "; ".join(bf.check_args(args))
    assert "--topk-split: 1000 is not a power of two" in problems and "--topk-split: 8 " in problems
    assert "1024" not in problems
    row = dict(rows=8, blocks=8192, k=32, prr_us=22.0, fi_top_k_us=12.0, fi_page_table_us=11.0, floor_us=1.0,
               sets_equal=True, split1024_us=8.8, split2048_us=9.5, split_us=8.8, split_chunk=1024)
    cells = [c.strip() for c in bf.topk_table([row]).splitlines()[2].strip("|").split("|")]
    assert cells[7] == "2" and cells[9] == "yes"  # the columns before the split ones are unchanged
    assert cells[10] == "8.8" and cells[11] == "1024" and cells[12] == "0.8"
    no_split = [c.strip() for c in bf.topk_table([dict(row, split_us=None, split_chunk=None)]).splitlines()[2]
                .strip("|").split("|")]
    assert no_split[10] == "-" and no_split[12] == "-"


def test_split_chunks_keep_what_topk_select_accepts():
    """Chunks smaller than the row whose merge (chunks x min(k, chunk) candidates) fits MAX_ROW_BLOCK."""
    from prr.kernels.topk import MAX_ROW_BLOCK

    assert bf.split_chunks([256, 512, 1024, 2048, 8192], 128, 8192) == [256, 512, 1024, 2048]
    assert bf.split_chunks([256, 512, 1024], 512, 8192) == [256, 512, 1024]  # 32 x 256 = 8192 candidates
    assert bf.split_chunks([16, 64, 1024, 4096], 512, 65536) == [4096]  # 16 x 512; the others > MAX_ROW_BLOCK
    assert MAX_ROW_BLOCK == 16384
    from prr.kernels.topk import _check_split

    chunks = [16 << i for i in range(11)]
    for n in (2048, 8192, 8176, 65536):
        for k in (32, 128, 512):
            for c in chunks:
                try:
                    _check_split(c, k, n)
                    accepted = True
                except ValueError:
                    accepted = False
                assert (c in bf.split_chunks(chunks, k, n)) == (accepted and c < n), (n, k, c)


def test_missed_pages_are_a_minus_p_in_static_shapes():
    """A \\ P per row for the FlashInfer-composed PRR: the pages of A not in P, ascending, the same
    count in every row; A in any order, pages above or below every page of P."""
    import torch

    p_sorted = torch.tensor([[3, 8, 20, 41], [100, 101, 102, 150]], dtype=torch.int32)
    table = torch.tensor([[99, 8, 2, 41], [150, 7, 101, 200]], dtype=torch.int32)  # 2 misses per row
    got = bf.missed_pages(table, p_sorted, 2)
    assert got.dtype == torch.int32 and torch.equal(got, torch.tensor([[2, 99], [7, 200]], dtype=torch.int32))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # random rows against a set-difference reference
        pool = torch.randperm(500, generator=gen)[:60].to(torch.int32)
        a, extra = pool[:24], pool[24:]
        p = torch.cat([a[:19], extra[:5]]).sort().values  # 19 hits, 5 false positives
        row = bf.missed_pages(a[torch.randperm(24, generator=gen)].view(1, -1), p.view(1, -1), 5)
        assert torch.equal(row[0], a[19:].sort().values)


def test_prr_table_ratios():
    """PRR over serial within each implementation, prr over FlashInfer, the best of each over the floor."""
    row = dict(batch=1, context=131072, block_size=16, budget_tokens=2048, hit_rate=0.9, engine_serial_us=40.0,
               engine_prr_us=44.0, engine_superset_us=42.0, fi_serial_us=50.0, fi_prr_us=80.0, floor_us=10.0,
               max_abs_fi_prr_vs_engine=0.001)
    cells = [c.strip() for c in bf.prr_table([row]).splitlines()[2].strip("|").split("|")]
    assert cells[:5] == ["1", "128", "16", "2048", "0.9"]
    assert cells[10] == "1.1" and cells[11] == "1.6"  # PRR (exact) / serial, FI PRR / FI serial
    assert cells[12] == "0.525"  # prr superset / FI PRR: the same method
    assert cells[13] == "0.8" and cells[15] == "4"  # best prr (serial 40) / best FI (serial 50); 40 / floor 10
    text = bf.report({"command": "c", "bandwidth_GBps": 1.0, "environment": {}, "prr": [row]})
    assert "## PRR beside serial DSA" in text


def test_topk_radix_argument_and_columns():
    assert bf.parse_args([]).topk_radix == [] and bf.parse_args(["--topk-radix", "1"]).topk_radix == [1]
    args = bf.parse_args([])
    args.topk_radix = [3, 2, 1]
    problems = "; ".join(bf.check_args(args))
    assert "--topk-radix: 3 is not one of" in problems and "--topk-radix: 2 " in problems  # 2 is the default
    assert "--topk-radix: 1 " not in problems
    row = dict(rows=8, blocks=8192, k=128, prr_us=17.6, fi_top_k_us=12.0, fi_page_table_us=10.0, floor_us=1.0,
               sets_equal=True, radix1_us=8.0, radix_us=8.0, radix_bits=1)
    cells = [c.strip() for c in bf.topk_table([row]).splitlines()[2].strip("|").split("|")]
    assert cells[13] == "8" and cells[14] == "1" and cells[15] == "0.8"


def test_prr_part_needs_full_blocks_of_context_minus_headroom():
    """The prr part holds context - 256 tokens: refused at parse time where that is not whole blocks
    or is shorter than the budget (one line, exit 2), and only when the part runs."""
    args = bf.parse_args(["--parts", "prr"])
    args.contexts, args.blocks, args.budgets = [8192], [512], [8192]
    problems = "; ".join(bf.check_args(args))
    assert "holds 8192 - 256 tokens, not a multiple of block size 512" in problems
    assert "--budgets: 8192 exceeds the prr part's 7936 tokens" in problems
    args.parts = ["attention"]
    assert not any("prr part" in p for p in bf.check_args(args))


def test_topk_filter_settings_variants_and_columns():
    """--topk-filter: off / CAP / CAPrB become topk_select keywords; bad settings are one clear error;
    the table shows the fastest setting."""
    assert bf.parse_args([]).topk_filter == []
    assert bf.parse_args(["--topk-filter", "off,512,2048r2"]).topk_filter == ["off", "512", "2048r2"]
    assert bf.filter_kwargs("off") == dict(candidate_filter=False)
    assert bf.filter_kwargs("512") == dict(candidate_cap=512, candidate_radix_bits=4)  # as when the sweep ran
    assert bf.filter_kwargs("2048r2") == dict(candidate_cap=2048, candidate_radix_bits=2)
    for bad in ("500", "8", "512r3", "r2", "on", "512r", "512r22"):
        with pytest.raises(ValueError, match=repr(bad)):
            bf.filter_kwargs(bad)
    names = [n for n, _ in bf.topk_variants([1024, 4096], [1], ["off", "512r2"], 128, 2048)]
    assert names == ["split1024", "radix1", "filter_off", "filter_512r2"]  # 4096 is not smaller than the row
    row = dict(rows=8, blocks=8192, k=128, prr_us=17.6, fi_top_k_us=12.0, fi_page_table_us=10.0, floor_us=1.0,
               sets_equal=True, filter_off_us=19.0, filter_2048r2_us=8.0, filter_1024_us=9.0)
    assert bf.best_variant(row, "filter") == ("2048r2", 8.0)
    assert bf.best_variant(dict(prr_split1024_us=3.0, prr_split_us=1.0, prr_serial_us=0.5), "split", "prr_") == ("1024", 3.0)
    row["filter_setting"], row["filter_us"] = bf.best_variant(row, "filter")
    cells = [c.strip() for c in bf.topk_table([row]).splitlines()[2].strip("|").split("|")]
    assert cells[16:19] == ["8", "2048r2", "0.8"]


def test_selection_disagreement_tells_a_tie_from_a_worse_set():
    import torch

    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0], [2.0, 9.0, 8.0, 7.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    prr = torch.tensor([[0, 2], [1, 2], [4, 3]])
    assert bf.selection_disagreement(scores, prr, prr.flip(-1)) == dict(rows_differ=0, score_margin=None)
    tie = torch.tensor([[0, 3], [1, 2], [3, 4]])  # row 0: block 3 ties block 2 at the k-th score
    assert bf.selection_disagreement(scores, prr, tie) == dict(rows_differ=1, score_margin=0.0)
    worse = torch.tensor([[0, 2], [1, 3], [4, 3]])  # row 1: FlashInfer took 7 over 8
    assert bf.selection_disagreement(scores, prr, worse) == dict(rows_differ=1, score_margin=1.0)
    both = bf.selection_disagreement(scores, worse, tie)  # row 0: prr's 3 vs 3 (tie); row 1: prr's 7 vs 8
    assert both == dict(rows_differ=2, score_margin=-1.0)


def test_the_benchmarks_outputs_are_strict_json_a_csv_with_the_command_and_the_report(tmp_path):
    """write_bench_outputs: a NaN cell is null in the JSON (strict), every CSV row carries the
    command, the markdown is the report's, and a missing folder is made."""
    import csv
    import json

    from prr.bench_args import write_bench_outputs

    record = {"command": "python x.py", "rows": [{"us": 1.5, "ratio": float("nan")}, {"us": 2.0, "extra": "a"}]}
    out = tmp_path / "new" / "bench"
    text = write_bench_outputs(record, out, lambda r: f"{len(r['rows'])} cells")
    assert text == "2 cells" == out.with_suffix(".md").read_text().strip()
    assert json.loads(out.with_suffix(".json").read_text(), parse_constant=lambda c: 1 / 0)["rows"][0]["ratio"] is None
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert [r["command"] for r in rows] == ["python x.py"] * 2 and rows[1]["extra"] == "a" and rows[0]["us"] == "1.5"
