"""The benchmark harness on the tiny pair: same outputs, ratios from the same run, reports, the app's page."""

import csv
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from explorer.analysis.bench import (HF_ASSISTED, HF_ASSISTED_BF16, HF_GENERATE, aggregate, bench,
                                     hf_assisted_effective, hf_assisted_settings)
from explorer.analysis.report import ReportError, load_report, loads_report, write_reports
from explorer.cli.main import main
from explorer.models.loading import quantize_draft
from explorer.trace.records import load_run

APP = str(Path(__file__).resolve().parent.parent / "app.py")


@pytest.fixture(scope="module")
def quantized(tiny):
    """The tiny pair with an int8 draft, keeping the float draft for ``hf-assisted-bf16``."""
    return quantize_draft(tiny, "int8", keep_unquantized=True)


@pytest.fixture(scope="module")
def settings_before(quantized):
    return hf_assisted_settings(quantized.draft), hf_assisted_settings(quantized.unquantized_draft)


@pytest.fixture(scope="module")
def result(quantized, settings_before):
    tiny = quantized
    ids = [tiny.tokenizer.encode("def add(a, b):"), tiny.tokenizer.encode("The quick brown fox")]
    out = bench(tiny, ids, methods=("ar", HF_GENERATE, HF_ASSISTED_BF16, HF_ASSISTED, "sd", "mcsd-improved"),
                temperatures=(0.0,), max_new_tokens=12, warmup=0)
    out["meta"] = {"prompt_set": "unit", "max_new_tokens": 12, "pair": tiny.name, "dtype": "float32",
                   "device": "cpu", "machine": "test", "torch": "x", "transformers": "y"}
    return out


def test_greedy_outputs_agree_across_methods_and_with_hf_assisted(result):
    for prompt in (0, 1):
        runs = {r["method"]: r["token_ids"] for r in result["runs"] if r["prompt"] == prompt}
        assert len(runs["ar"]) == 12
        assert runs[HF_ASSISTED] == runs[HF_ASSISTED_BF16] == runs["ar"] == runs["sd"] == runs["mcsd-improved"]
        assert runs[HF_GENERATE] == runs["ar"]  # transformers' plain decoding writes what ours does


def test_the_quantized_draft_is_int8_and_proposes_close_to_the_float_one(tiny, quantized):
    import torch

    assert quantized.draft_quant == "int8" and quantized.unquantized_draft is tiny.draft
    assert quantized.target is tiny.target and tiny.draft_quant == "none"
    kinds = {type(m).__name__ for m in quantized.draft.modules()}
    assert "Linear" in kinds and any("Quantized" in str(type(m)) or "quantized" in type(m).__module__
                                     for m in quantized.draft.modules())
    ids = torch.tensor([tiny.tokenizer.encode("def add(a, b): return a + b")])
    with torch.inference_mode():
        q_float = torch.softmax(tiny.draft(ids).logits.float(), -1)
        q_int8 = torch.softmax(quantized.draft(ids).logits.float(), -1)
    tv = 0.5 * (q_float - q_int8).abs().sum(-1)
    assert q_int8.dtype == torch.float32 and float(tv.mean()) < 0.1 and float(tv.max()) < 0.25  # close, not equal


def test_summary_ratios_come_from_the_same_run(result):
    s = {r["method"]: r for r in result["summary"]}
    assert s["ar"]["speedup_vs_ar"] == pytest.approx(1.0) and s[HF_ASSISTED]["ratio_vs_hf"] == pytest.approx(1.0)
    assert s["sd"]["speedup_vs_ar"] == pytest.approx(s["sd"]["tokens_per_s"] / s["ar"]["tokens_per_s"])
    assert s["sd"]["tokens_per_s"] == pytest.approx(s["sd"]["generated_tokens"] / s["sd"]["seconds"])
    assert s["ar"]["tokens_per_target_call"] == pytest.approx(1.0)
    assert s["sd"]["draft_s"] > 0 and s["sd"]["other_s"] >= -1e-6
    assert 0 < s["sd"]["overhead_share"] < 1 and s[HF_ASSISTED]["overhead_share"] is None
    assert s[HF_ASSISTED]["ratio_vs_hf_bf16"] == pytest.approx(
        s[HF_ASSISTED]["tokens_per_s"] / s[HF_ASSISTED_BF16]["tokens_per_s"])
    assert s[HF_ASSISTED]["target_calls"] is None and s[HF_ASSISTED]["config"] == result["hf_assisted"]


def test_aggregate_sums_then_divides():
    rows = [{"generated_tokens": 10, "seconds": 1.0, "target_calls": 5, "drafted_tokens": 8,
             "accepted_draft_tokens": 4, "draft_ms": 300.0, "verify_ms": 500.0, "acceptance_rate": 0.5,
             "draft_calls": 3},
            {"generated_tokens": 30, "seconds": 4.0, "target_calls": 10, "drafted_tokens": 12,
             "accepted_draft_tokens": 6, "draft_ms": 1000.0, "verify_ms": 2000.0, "acceptance_rate": 0.3,
             "draft_calls": 6}]
    a = aggregate(rows)
    assert a["tokens_per_s"] == pytest.approx(8.0) and a["tokens_per_target_call"] == pytest.approx(40 / 15)
    assert a["mcsd_acceptance_rate"] == pytest.approx(0.5) and a["other_s"] == pytest.approx(5.0 - 1.3 - 2.5)
    assert a["cost_ratio"] is None  # no goodput policy measured its r
    rows[0]["cost_ratio"], rows[1]["cost_ratio"] = 0.04, 0.08
    assert aggregate(rows)["cost_ratio"] == pytest.approx(0.06)


def test_hf_assisted_leaves_the_shared_draft_settings_alone(quantized, settings_before, result):
    # generate() adapts num_assistant_tokens on the assistant it is given; the runs above must undo that
    assert (hf_assisted_settings(quantized.draft), hf_assisted_settings(quantized.unquantized_draft)) \
        == settings_before
    assert result["hf_assisted"] == hf_assisted_effective(quantized.draft)  # what generate ran with


def test_hf_assisted_bf16_refuses_a_quantized_pair_without_its_float_draft(tiny):
    pair = quantize_draft(tiny, "int8")  # keep_unquantized=False
    with pytest.raises(ValueError, match="unquantized draft"):
        bench(pair, [[1, 2, 3]], methods=("ar", HF_ASSISTED_BF16), max_new_tokens=2, warmup=0)


def test_reports_are_written_and_read_back(result, tmp_path):
    paths = write_reports(result, tmp_path)
    assert load_report(paths["json"])["summary"] == result["summary"]
    with paths["csv"].open() as f:
        assert len(list(csv.DictReader(f))) == len(result["runs"])
    md = paths["md"].read_text()
    assert "| hf-assisted |" in md and "speed-up vs ar" in md
    page = paths["html"].read_text()
    assert page.count("plotly-graph-div") >= 2 and "<table>" in page
    for bad, msg in ((b"{", "not valid JSON"), (b"[]", "not a benchmark report"),
                     (json.dumps({"meta": {}}).encode(), "not a benchmark report")):
        with pytest.raises(ReportError, match=msg):
            loads_report(bad)
    with pytest.raises(ReportError, match="cannot read"):
        load_report(tmp_path / "missing.json")


def test_bench_cli_on_the_tiny_pair(tmp_path, capsys):
    rc = main(["bench", "--models", "tiny", "--prompt-file", "mt-bench", "--range", "0:1", "--methods",
               "ar,hf-assisted,mcsd", "--max-new-tokens", "6", "--warmup", "0", "--out", str(tmp_path),
               "--save-traces", str(tmp_path / "traces")])
    assert rc == 0 and (tmp_path / "bench.html").exists()
    assert "| mcsd |" in capsys.readouterr().out
    # each timed run of our engine is kept, with its prompt's set and id, for forensics (none of transformers')
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["ar", "mcsd"]
    [kept] = list((tmp_path / "traces" / "mcsd").glob("*.json"))
    assert load_run(kept).prompt_info["source"] == "mt-bench"
    assert main(["forensics", "--trace", str(tmp_path / "traces" / "mcsd"), "--out", str(tmp_path / "fo")]) == 0
    # the machine line names the CPU's vector capability (two EPYCs: AVX2 in fp32 against AVX-512 with bf16)
    machine = load_report(tmp_path / "bench.json")["meta"]["machine"]
    assert f"({torch.backends.cpu.get_cpu_capability()})" in machine
    assert main(["bench", "--models", "tiny", "--prompt-file", "mt-bench", "--methods", "ar,warp-drive",
                 "--out", str(tmp_path)]) == 2


def test_sampled_runs_repeat_each_prompt_with_its_own_seeds_and_greedy_runs_once(tiny, tmp_path, capsys):
    ids = [tiny.tokenizer.encode("def add(a, b):"), tiny.tokenizer.encode("The quick brown fox")]
    out = bench(tiny, ids, methods=("ar", "sd"), temperatures=(0.0, 1.0), max_new_tokens=8, warmup=0, samples=3)
    runs = {(r["temperature"], r["method"]): [] for r in out["runs"]}
    for r in out["runs"]:
        runs[r["temperature"], r["method"]].append((r["prompt"], r["sample"]))
    assert runs[0.0, "ar"] == [(0, 0), (1, 0)]  # greedy: one run a prompt
    assert runs[1.0, "sd"] == [(p, s) for p in (0, 1) for s in range(3)]
    texts = [tuple(r["token_ids"]) for r in out["runs"]
             if r["temperature"] == 1.0 and r["method"] == "ar" and r["prompt"] == 0]
    assert len(set(texts)) > 1  # each sample draws with its own seed
    summary = next(s for s in out["summary"] if s["temperature"] == 1.0 and s["method"] == "ar")
    assert summary["generated_tokens"] == sum(r["generated_tokens"] for r in out["runs"]
                                              if r["temperature"] == 1.0 and r["method"] == "ar")
    with pytest.raises(ValueError, match="samples must be at least 1"):
        bench(tiny, ids, methods=("ar",), max_new_tokens=2, warmup=0, samples=0)
    rc = main(["bench", "--models", "tiny", "--prompt-file", "mt-bench", "--range", "0:1", "--methods", "ar",
               "--temperatures", "0.7", "--samples", "2", "--max-new-tokens", "4", "--warmup", "0",
               "--out", str(tmp_path)])
    assert rc == 0 and "2 samples per prompt at T > 0" in capsys.readouterr().out


def test_benchmarks_page(result, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_EXPLORER_PAIR", "tiny")
    monkeypatch.setenv("SPEC_EXPLORER_BENCH", str(tmp_path / "nothing.json"))
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.query_params["page"] = "benchmarks"  # as an old ?page= link does: app.py switches to the page
    at.run()
    # never empty: with no report of the user's, the reference reports shipped in assets/bench are shown
    assert not at.exception and any("No report of yours" in i.value for i in at.info)
    assert set(at.selectbox(key="bench_reference").options) == {"humaneval", "mt-bench", "kinds", "kinds-greedy",
                                                                  "kinds-eagle", "humaneval-eagle"}
    # both prompt sets were measured on the CPU and on a GPU: side by side, then each report in its tab
    assert len(at.dataframe) == 3 and [t.label for t in at.tabs] == ["CPU", "GPU"]
    assert {"CPU x ar", "GPU x ar"} <= set(at.dataframe[0].value.columns)
    folder = Path(APP).parent / "assets" / "bench"
    for name in ("cpu-humaneval", "cpu-mt-bench", "gpu-humaneval", "gpu-mt-bench"):
        meta = load_report(folder / f"{name}.json")["meta"]
        assert meta["machine"] and meta["date"] and meta["commit"] and "(embedded)" in meta["pair"]
        assert meta["device"].startswith("cuda" if name.startswith("gpu") else "cpu")
        assert meta["prompt_set"] == f"{name.split('-', 1)[1]}:0:3" and meta["max_new_tokens"] == 128
    # the kinds set, measured on two CPUs (CPU B in bf16 as "cpu", CPU C in fp32 as "cpuc"; T 0.7, and greedy apart):
    # each report with a table per kind of prompt
    for name, temperature in (("cpu-kinds", 0.7), ("cpu-kinds-greedy", 0.0), ("cpuc-kinds", 0.7),
                              ("cpuc-kinds-greedy", 0.0)):
        kinds = load_report(folder / f"{name}.json")
        assert kinds["meta"]["prompt_set"] == "kinds" and kinds["meta"]["commit"] and kinds["meta"]["date"]
        assert kinds["meta"]["temperatures"] == [temperature]
        assert kinds["meta"]["dtype"] == ("float32" if name.startswith("cpuc") else "bfloat16")
        assert {r["kind"] for r in kinds["by_kind"]} == {"code", "chat", "math", "qa", "translation",
                                                          "summarisation", "reasoning"}
    # side by side, then each machine's summary and table by kind in its tab
    at.selectbox(key="bench_reference").set_value("kinds").run()
    assert not at.exception and not at.error and len(at.dataframe) == 5
    assert [t.label for t in at.tabs] == ["CPU", "CPUC"] and "CPUC x ar" in at.dataframe[0].value.columns
    # CPU C's T 0.7 report predates the online width: its tab says so, CPU B's (made since) does not
    notes = [c.value for c in at.caption if "made before the default chose its root width online" in c.value]
    assert len(notes) == 1
    at.selectbox(key="bench_reference").set_value("kinds-eagle").run()  # the head on two CPUs, side by side
    assert not at.exception and not at.error and [t.label for t in at.tabs] == ["CPU", "CPUA"]
    assert "CPUA x ar" in at.dataframe[0].value.columns
    assert not [c for c in at.caption if "16 best nodes" in c.value]  # both made since the sizing (label_notes below)
    at.selectbox(key="bench_reference").set_value("humaneval-eagle").run()  # the head on a GPU, one report
    assert not at.exception and not at.error and [t.label for t in at.tabs] == []
    head_gpu = load_report(folder / "gpu-humaneval-eagle.json")
    assert head_gpu["meta"]["device"].startswith("cuda") and head_gpu["meta"]["graphs"]
    assert {"ar", "eagle", "sd+chain=4", "hf-assisted"} <= {r["method"] for r in head_gpu["summary"]}
    at.selectbox(key="bench_reference").set_value("kinds-greedy").run()  # both made since: no such note
    assert not at.exception and not at.error and len(at.dataframe) == 5
    assert not any("made before the default" in c.value for c in at.caption)
    assert {"kind", "ratio_vs_hf", "ratio_vs_best_hf"} <= set(at.dataframe[2].value.columns)
    write_reports(result, tmp_path)
    monkeypatch.setenv("SPEC_EXPLORER_BENCH", str(tmp_path / "bench.json"))
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.query_params["page"] = "benchmarks"  # as an old ?page= link does: app.py switches to the page
    at.run()
    # the user's report first; the references stay in an expander below it
    assert not at.exception and not at.error and len(at.dataframe) == 4
    assert at.expander[0].label.startswith("Reference reports")
    (tmp_path / "bench.json").write_text("{broken")
    at.run()
    assert any("Cannot show this report" in e.value for e in at.error)


def test_label_notes_say_what_mcsd_improved_meant_when_a_report_was_made():
    from explorer.ui.bench_page import label_notes

    def report(date, methods=("ar", "mcsd-improved")):
        return {"meta": {"date": date}, "summary": [{"method": m} for m in methods]}

    assert any("published tree" in n for n in label_notes(report("2026-11-25T14:38:31+00:00")))  # the width then
    assert not any("published tree" in n for n in label_notes(report("2026-11-27T00:16:00+00:00")))  # online since
    assert not any("published tree" in n for n in label_notes(report("2026-11-25T14:38:31+00:00", ("ar", "hybrid"))))
    assert not label_notes({"meta": {}, "summary": [{"method": "mcsd-improved"}]})  # undated: nothing to say
    assert any("16 best nodes" in n for n in label_notes(report("2026-11-28T03:08:31+00:00", ("ar", "eagle"))))
    assert not label_notes(report("2026-11-28T06:00:00+00:00", ("ar", "eagle")))  # sized online since
    # the prefill apart from the first verification, before the bench joined them (not where forwards were graphed)
    assert any("prefilled the target apart" in n for n in label_notes(report("2026-11-27T00:16:00+00:00")))
    assert not label_notes(report("2026-11-27T04:35:00+00:00"))
    graphed = {"meta": {"date": "2026-11-26T10:00:00+00:00", "graphs": True}, "summary": [{"method": "hybrid"}]}
    assert not label_notes(graphed)
    assert not label_notes(report("2026-11-25T14:38:31+00:00", ("ar", "hf-assisted")))


def test_references_side_by_side_line_up_each_method():
    from explorer.ui.bench_page import reference_sets, side_by_side

    sets = reference_sets()
    assert list(sets["humaneval"]) == ["cpu", "gpu"]
    reports = {m: load_report(p) for m, p in sets["humaneval"].items()}
    rows = side_by_side(reports)
    ar = next(r for r in rows if r["method"] == "ar" and r["temperature"] == 0.0)
    assert ar["CPU x ar"] == ar["GPU x ar"] == 1.0
    gpu = {(r["temperature"], r["method"]): r for r in reports["gpu"]["summary"]}
    for row in rows:
        found = gpu.get((row["temperature"], row["method"]))
        assert row["GPU tok/s"] == (round(found["tokens_per_s"], 2) if found else None)
    assert [r["temperature"] for r in rows] == sorted(r["temperature"] for r in rows)


def test_the_page_runs_a_small_benchmark(tiny, tmp_path, monkeypatch):
    """The page's button runs ar, mcsd-improved and transformers' assisted generation with a progress bar and
    shows the report it wrote (the embedded pair's loader swapped for the tiny pair here)."""
    from explorer.ui import bench_page, common

    monkeypatch.setattr(common, "load_pair_with_progress", lambda *a: tiny)
    # the tiny pair's byte-level tokens hold 512 positions: HumanEval's prompts are longer there
    monkeypatch.setitem(bench_page.SMALL_BENCH, "prompts", "mt-bench:0:2")
    monkeypatch.setenv("SPEC_EXPLORER_BENCH", str(tmp_path / "bench.json"))
    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    at.query_params["page"] = "benchmarks"  # as an old ?page= link does: app.py switches to the page
    at.run()
    at.button(key="bench_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    report = load_report(tmp_path / "bench.json")
    assert {r["method"] for r in report["summary"]} == {"ar", "mcsd-improved", "hf-assisted"}
    assert report["meta"]["prompt_set"] == "mt-bench:0:2"
    # the new report's table first, then the shipped references (side by side, a tab each) in their expander
    assert len(at.dataframe) == 4 and at.expander[0].label.startswith("Reference reports")
    assert {r["method"] for r in at.dataframe[0].value.to_dict("records")} == {"ar", "mcsd-improved", "hf-assisted"}


def test_a_chain_label_runs_the_method_with_chain_replays(tiny, monkeypatch):
    """``+chain=N`` is an engine setting beside the method: the same config, ``chain_levels`` N for that label alone,
    the bench's ``chain_levels`` for the others; it needs graphs."""
    import explorer.analysis.bench as bench_module
    from explorer.analysis.bench import bench, chain_of, method_for_label
    from explorer.engine.config import DEFAULTS

    assert method_for_label("mcsd-improved+chain=16") == DEFAULTS["mcsd-improved"]
    assert (chain_of("mcsd-improved+chain=16"), chain_of("mcsd-improved", 8), chain_of("sd+chain=0", 8)) == (16, 8, 0)
    with pytest.raises(ValueError, match="chain"):
        chain_of("sd+chain=many")
    seen, real = [], bench_module.run_engine

    def spy(pair, config, ids, n, sampling, **kw):
        seen.append(kw["chain_levels"])
        return real(pair, config, ids, n, sampling, **kw)

    monkeypatch.setattr(bench_module, "run_engine", spy)
    ids = [tiny.tokenizer.encode("def add(a, b):")]
    methods = ["sd", "sd+chain=4"]
    configs = {m: method_for_label(m).with_(fallback="off") for m in methods}
    out = bench(tiny, ids, methods=methods, configs=configs, max_new_tokens=12, warmup=0, kv_cache="static",
                graphs=True)
    rows = {r["method"]: r for r in out["runs"]}
    assert rows["sd"]["token_ids"] == rows["sd+chain=4"]["token_ids"]  # greedy: the same text either way
    assert seen == [0, 4]
    with pytest.raises(Exception, match="chain_levels"):
        bench(tiny, ids, methods=["sd+chain=4"], max_new_tokens=4, warmup=0)


def test_the_bench_joins_the_prefill_but_where_a_label_keeps_it_apart(tiny):
    """The bench runs the engine as transformers' assisted generation runs: the first tree verified in the
    prefill's forward (one target call fewer); ``+prefill=apart`` keeps the prefill apart, the method the same."""
    from explorer.analysis.bench import bench, joint_prefill_of, method_for_label
    from explorer.engine.config import DEFAULTS

    assert method_for_label("sd+prefill=apart+carry=off") == DEFAULTS["sd"]
    assert joint_prefill_of("sd") and joint_prefill_of("sd+carry=off") and not joint_prefill_of("sd+prefill=apart")
    ids = [tiny.tokenizer.encode("def add(a, b):")]
    methods = ["sd", "sd+prefill=apart"]
    configs = {m: method_for_label(m).with_(fallback="off") for m in methods}
    rows = {r["method"]: r for r in bench(tiny, ids, methods=methods, configs=configs, max_new_tokens=12,
                                          warmup=0)["runs"]}
    joined, apart = rows["sd"], rows["sd+prefill=apart"]
    assert joined["token_ids"] == apart["token_ids"]
    assert joined["target_calls"] == apart["target_calls"] - 1 and joined["steps"] == apart["steps"]


def test_a_self_draft_runs_eagerly_in_a_graphed_bench_and_the_report_says_so(tmp_path, capsys):
    """``layer-skip`` moves its exit layer between steps, so it cannot run on the static cache graphs need: a bench
    asked for graphs runs it on the dynamic cache (before, the whole run stopped with an error after loading), keeps
    graphs for the others, and marks its rows."""
    rc = main(["bench", "--models", "tiny", "--prompt-file", "mt-bench", "--range", "0:1", "--methods",
               "ar,layer-skip", "--max-new-tokens", "8", "--graphs", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["method"]: r for r in load_report(tmp_path / "bench.json")["summary"]}
    assert rows["layer-skip"]["eager"] and "eager" not in rows["ar"]
    assert rows["layer-skip"]["generated_tokens"] == 8
    out = capsys.readouterr().out
    assert "| layer-skip (eager) |" in out and "| ar |" in out


def test_the_bench_carries_what_a_run_learned_to_the_next_prompt(tiny, monkeypatch):
    """Token Recycling's matrix, the goodput fallback's rates and the stop policy's adaptation go to the method's
    next prompt within a temperature; a ``+carry=off`` label starts every run afresh."""
    import explorer.analysis.bench as bench_module
    from explorer.analysis.bench import carries, method_for_label
    from explorer.engine.config import DEFAULTS

    assert method_for_label("hybrid+carry=off") == DEFAULTS["hybrid"] and not carries("hybrid+carry=off")
    with pytest.raises(ValueError):
        method_for_label("hybrid+carry=on")
    seen, real = [], bench_module.run_engine

    def spy(pair, config, ids, n, sampling, **kw):
        c = kw.get("carried")
        seen.append(tuple(c is not None and getattr(c, part) is not None
                          for part in ("recycling", "fallback", "adapter")))
        return real(pair, config, ids, n, sampling, **kw)

    monkeypatch.setattr(bench_module, "run_engine", spy)
    ids = [tiny.tokenizer.encode("def add(a, b):"), tiny.tokenizer.encode("The quick brown fox")]
    label = "token-recycling+fallback=goodput"
    bench(tiny, ids, methods=(label, label + "+carry=off"), temperatures=(0.0, 0.7), max_new_tokens=8, warmup=0)
    first, afresh, carried = (False, False, False), (False, False, False), (True, True, False)
    assert seen == [first, afresh, carried, afresh] * 2  # per temperature: prompt 0, then prompt 1
    seen.clear()  # and the stop policy's online adaptation
    label = "mcsd-improved+adapt=last-layer+fallback=off"  # auto would time the machine: a busy one falls back
    bench(tiny, ids, methods=(label, label + "+carry=off"), temperatures=(0.0,), max_new_tokens=8, warmup=0)
    assert seen == [first, afresh, (False, False, True), afresh]


def test_the_report_names_the_assistant_settings_generate_runs_with(tiny):
    """Where the draft's generation config leaves them unset, the report gives transformers' defaults, not None."""
    effective = hf_assisted_effective(tiny.draft)
    assert effective == {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                         "assistant_confidence_threshold": 0.4}


def test_the_bench_summarises_each_kind_against_its_own_baselines(tiny, tmp_path, monkeypatch):
    """With the prompts' kinds, ``by_kind`` aggregates each kind's runs alone, its ratios divide by the same kind's
    baselines, and the reports hold a table per kind; ``layer-skip``'s exit chooser goes to the next prompt."""
    import explorer.analysis.bench as bench_module
    from explorer.analysis.report import kind_table

    seen, real = [], bench_module.run_engine

    def spy(pair, config, ids, n, sampling, **kw):
        if config.method == "layer-skip":
            seen.append(kw.get("carried") is not None and kw["carried"].layer_skip is not None)
        return real(pair, config, ids, n, sampling, **kw)

    monkeypatch.setattr(bench_module, "run_engine", spy)
    texts = ("def add(a, b):", "def sub(a, b):", "The quick brown fox", "Once upon a time")
    kinds = ["code", "code", "chat", "chat"]
    out = bench(tiny, [tiny.tokenizer.encode(t) for t in texts], methods=("ar", HF_ASSISTED, "sd", "layer-skip"),
                temperatures=(0.0,), max_new_tokens=8, warmup=0, kinds=kinds)
    assert seen == [False, True, True, True]
    assert [r["kind"] for r in out["runs"] if r["method"] == "ar"] == kinds
    rows = {(r["kind"], r["method"]): r for r in out["by_kind"]}
    assert len(rows) == 8
    for kind in ("code", "chat"):
        runs = [r for r in out["runs"] if r["kind"] == kind]
        for method in ("sd", "layer-skip"):
            mine = aggregate([r for r in runs if r["method"] == method])
            ar = aggregate([r for r in runs if r["method"] == "ar"])
            hf = aggregate([r for r in runs if r["method"] == HF_ASSISTED])
            assert rows[kind, method]["tokens_per_s"] == pytest.approx(mine["tokens_per_s"])
            assert rows[kind, method]["speedup_vs_ar"] == pytest.approx(mine["tokens_per_s"] / ar["tokens_per_s"])
            assert rows[kind, method]["ratio_vs_best_hf"] == pytest.approx(mine["tokens_per_s"] / hf["tokens_per_s"])
    out["meta"] = {"prompt_set": "unit", "max_new_tokens": 8, "pair": tiny.name, "dtype": "float32",
                   "device": "cpu", "machine": "test", "torch": "x", "transformers": "y"}
    paths = write_reports(out, tmp_path)
    md = paths["md"].read_text()
    assert "By kind of prompt" in md and "| 0 | chat | layer-skip |" in md and kind_table(out) in md
    assert "<h2>By kind of prompt</h2>" in paths["html"].read_text()
    assert load_report(paths["json"])["by_kind"] == out["by_kind"]
