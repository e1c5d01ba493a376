"""The systems benchmarks (bench/train_step.py, train_gpu.py, time_to_adapter.py, record.py) run end to
end on the tiny offline model and report figures that add up. No timing is asserted: figures are
for bench/RESULTS.md, not for CI."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl", reason="the KTO baseline needs TRL: pip install -e '.[bench]'")

from bench import answer_while_training, record, time_to_adapter, train_gpu, train_step  # noqa: E402
from bench.synthetic import llama_config  # noqa: E402


def test_train_step_compares_the_methods_on_the_same_tokens_and_profiles_a_step():
    # One run of every fp32 method (each is a process of its own that imports torch: one run, not one
    # a method). Two threads and small micro-batches: ours-serial differs from ours only there, and the
    # profile must see the step's products on the trainer's pool threads.
    from rlfleet.shared import allocator

    summary = train_step.main(["--model", "tiny", "--methods", "ours,ours-fp32,ours-serial,ours-glibc,kto,two-copy",
                               "--rounds", "1", "--steps", "2", "--samples", "6", "--prompt-chars", "40",
                               "--response-chars", "60", "--threads", "2", "--micro-batch-tokens", "128",
                               "--profile", "--json", "--no-record"])
    rows = {r["method"]: r for r in summary["rows"]}
    assert set(rows) == {"ours", "ours-fp32", "ours-serial", "ours-glibc", "kto", "two-copy"}
    assert rows["ours-fp32"]["precision"] == "fp32" and rows["ours-fp32"]["speed_vs_ours_fp32"] == 1.0
    assert {r["attention"] for r in rows.values()} == {"sdpa"}  # fp32 passes (auto on a toy model) use SDPA
    assert len({r["tokens_per_step"] for r in rows.values()}) == 1  # same ratings, same token count
    for r in rows.values():
        assert r["step_tokens_per_s"] > 0 and r["run_tokens_per_s"] > 0 and r["model_gflops_per_s"] > 0
        assert r["peak_bytes"] >= r["base_bytes"] > 0
    assert rows["kto"]["speed_vs_kto"] == 1.0
    ours, kto = rows["ours"], rows["kto"]
    assert ours["speed_vs_kto"] == pytest.approx(ours["step_tokens_per_s"] / kto["step_tokens_per_s"])
    assert summary["matmul_gflops_per_s"] > 0 and summary["matmul_bf16_gflops_per_s"] > 0
    # every variant of ours is a column the others are set against
    assert rows["ours-serial"]["speed_vs_ours_serial"] == 1.0
    assert ours["speed_vs_ours_serial"] == pytest.approx(
        ours["step_tokens_per_s"] / rows["ours-serial"]["step_tokens_per_s"])
    assert rows["ours-glibc"]["allocator"] == "system"
    # ours runs on what the training worker preloads: the wheel's mimalloc where the train extra is in
    assert ours["allocator"] == allocator.kind(allocator.library())
    assert ours["speed_vs_ours_glibc"] == pytest.approx(
        ours["step_tokens_per_s"] / rows["ours-glibc"]["step_tokens_per_s"])
    assert "speed vs ours glibc malloc" in train_step.table(summary["rows"])
    assert "speed vs ours serial" in train_step.table(summary["rows"])

    profile = summary["profile"]
    assert set(profile["self_seconds"]) == set(train_step.FAMILIES)
    assert profile["step_seconds"] > 0 and profile["self_seconds"]["other products"] > 0
    assert sum(profile["self_seconds"].values()) <= profile["step_seconds"] * 1.05 + 0.01  # one step, not the run
    ops = list(profile["ops"].items())
    assert 0 < len(ops) <= 15 and any(name in train_step.PRODUCTS for name, _ in ops)
    assert all(a[1] >= b[1] for a, b in zip(ops, ops[1:], strict=False))  # most self time first
    assert sum(s for _, s in ops) <= sum(profile["self_seconds"].values()) * 1.0001
    table = train_step.profile_table(profile)
    assert "operator (the" in table and f"| {ops[0][0]} |" in table


def test_train_step_sets_sdpa_attention_beside_ours():
    # bf16 on the tiny model (auto keeps a toy-sized model in fp32): ours stacks the grouped queries.
    summary = train_step.main(["--model", "tiny", "--methods", "ours,ours-sdpa", "--rounds", "1", "--steps", "2",
                               "--samples", "4", "--prompt-chars", "40", "--response-chars", "60", "--threads", "1",
                               "--precision", "bf16", "--json", "--no-record"])
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["ours"]["attention"] == "rlfleet_grouped" and rows["ours-sdpa"]["attention"] == "sdpa"
    assert rows["ours-sdpa"]["speed_vs_ours_sdpa"] == 1.0
    assert rows["ours"]["speed_vs_ours_sdpa"] == pytest.approx(
        rows["ours"]["step_tokens_per_s"] / rows["ours-sdpa"]["step_tokens_per_s"])
    assert "speed vs ours sdpa" in train_step.table(summary["rows"])


def test_train_step_sums_a_profile_by_family():
    vocab, rank = 1000, 8
    events = [
        ("aten::mm", [[30, 64], [64, vocab]], 500.0),  # the head
        ("aten::mm", [[30, 64], [64, rank]], 100.0),  # a LoRA product
        ("aten::addmm", [[64], [30, 64], [64, 64]], 200.0),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 4, 30, 16]], 50.0),
        ("aten::sub", [[30, vocab], [30, 1]], 80.0),  # the log-softmax's kind of work
        ("aten::_to_copy", [[30, 64]], 40.0),
        ("aten::mul", [[30, 64], [30, 64]], 30.0),
        ("aten::bmm", [[1, 60, 16], [1, 16, 30]], 20.0),  # the grouped attention's scores
        ("aten::_softmax", [[1, 1, 2, 30, 30]], 10.0),  # and their softmax
        ("aten::_softmax", [[30, vocab]], 7.0),  # a vocabulary-wide softmax is not attention's
    ]
    out = train_step.families(events, vocab, rank)
    assert out["head products"] == pytest.approx(5e-4) and out["LoRA products"] == pytest.approx(1e-4)
    assert out["other products"] == pytest.approx(2e-4) and out["attention"] == pytest.approx(8e-5)
    assert out["vocabulary-wide elementwise"] == pytest.approx(8.7e-5)
    assert out["casts and copies"] == pytest.approx(4e-5) and out["other"] == pytest.approx(3e-5)
    assert sum(out.values()) == pytest.approx(1.037e-3)
    assert train_step.families(events, None, rank)["head products"] == 0  # no head known: not guessed


def test_train_step_ranks_a_profiles_operators_over_their_shapes():
    events = [("aten::mm", [[30, 64], [64, 1000]], 500.0), ("aten::mm", [[30, 64], [64, 8]], 100.0),
              ("aten::sub", [[30, 1000]], 80.0), ("aten::addmm", [[64], [30, 64], [64, 64]], 200.0),
              ("aten::mul", [[30, 64]], 30.0)]
    assert train_step.top_ops(events) == pytest.approx({"aten::mm": 6e-4, "aten::addmm": 2e-4, "aten::sub": 8e-5,
                                                        "aten::mul": 3e-5})
    assert list(train_step.top_ops(events)) == ["aten::mm", "aten::addmm", "aten::sub", "aten::mul"]
    assert list(train_step.top_ops(events, n=2)) == ["aten::mm", "aten::addmm"]


def test_train_gpu_takes_the_unlikelihood_weight_and_profiles(capsys):
    figures = train_gpu.main(["--arch", "tiny", "--device", "cpu", "--steps", "2", "--samples", "2",
                              "--prompt-tokens", "16", "--response-tokens", "8", "--unlikelihood", "0",
                              "--precision", "bf16", "--profile", "--json", "--no-record"])
    assert figures["unlikelihood"] == 0
    assert figures["precision"] == "bf16"  # as asked (a bare preset would have run fp32)
    assert "Self CPU time total" in capsys.readouterr().err  # torch.profiler's table


def test_train_gpu_sums_a_profile_by_kernel_family():
    times = {  # kernel names as the H200's profile printed them, self device time in µs
        "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN": 300.0,
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32": 100.0,
        "void at::native::unrolled_elementwise_kernel<at::native::copy>": 400.0,
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wg": 100.0,
        "void at::native::reduce_kernel<512, 1>": 50.0,
        "ncclSomethingElse": 50.0,
    }
    shares = train_gpu.family_shares(times)
    assert list(shares)[0] == "elementwise (casts, pointwise)" and shares["elementwise (casts, pointwise)"] == 0.4
    assert shares["matmul fp32"] == pytest.approx(0.1)  # fp32 products are not counted as bf16 ones
    assert shares["matmul bf16/fp16"] == pytest.approx(0.3)
    assert shares["other"] == pytest.approx(0.05) and sum(shares.values()) == pytest.approx(1.0)


def test_train_gpu_reads_a_saved_profile_back(tmp_path, capsys):
    saved = tmp_path / "profile.txt"
    saved.write_text(
        "-------  ----\n"
        "                                                   Name    Self CPU %      Self CPU   CPU total %     "
        "CPU total  CPU time avg     Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls  \n"
        "         nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN         0.00%       0.000us         0.00%       0.000us"
        "       0.000us        1.500s        60.00%        1.500s     450.402us          2560  \n"
        "void at::native::unrolled_elementwise_kernel<at::nat...         0.00%       0.000us         0.00%       "
        "0.000us       0.000us     750.000ms        30.00%     750.000ms      46.860us         14960  \n"
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32...         0.00%       0.000us         0.00%       "
        "0.000us       0.000us     250.000ms        10.00%     250.000ms      31.151us         12288  \n"
        "Self CUDA time total: 2.500s\n")
    figures = train_gpu.main(["--families", str(saved)])
    assert figures["families"] == pytest.approx(
        {"matmul bf16/fp16": 0.6, "elementwise (casts, pointwise)": 0.3, "matmul fp32": 0.1})
    assert "60.0%  matmul bf16/fp16" in capsys.readouterr().out
    (tmp_path / "empty.txt").write_text("no table here\n")
    with pytest.raises(SystemExit):
        train_gpu.main(["--families", str(tmp_path / "empty.txt")])
    with pytest.raises(SystemExit):
        train_gpu.main(["--families", str(tmp_path / "missing.txt")])


def test_train_gpu_counts_exact_lengths_and_its_flops_by_hand():
    figures = train_gpu.main(["--arch", "tiny", "--device", "cpu", "--steps", "2", "--samples", "2",
                              "--prompt-tokens", "32", "--response-tokens", "16", "--json", "--no-record"])
    assert figures["tokens_per_step"] == 2 * (32 + 16)
    assert figures["precision"] == "fp32"  # auto: a 64-wide model on a CPU stays fp32
    assert figures["mfu"] is None and figures["tokens_per_s"] > 0
    # The FLOP count by hand for one sample on the tiny shape (d 64, i 128, 2 layers, 4 heads, 2 kv)
    from bench.synthetic import byte_tokenizer

    cfg = llama_config("tiny", byte_tokenizer())
    d, i, layers, v = 64, 128, 2, cfg.vocab_size
    kv = 2 * (d // 4)
    n_lin = layers * (2 * d * d + 2 * d * kv + 3 * d * i)
    n_lora = layers * 8 * ((d + d) * 2 + (d + kv) * 2 + (d + i) * 3)
    seq, resp = 48, 16
    expected = seq * (4 * n_lin + 6 * n_lora) + layers * 3 * d * seq * seq + resp * 4 * d * v
    assert train_gpu.step_flops(cfg, [(32, 16)], rank=8) == pytest.approx(expected)
    assert train_gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert train_gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert train_gpu.peak_tflops("a card nobody listed") is None


def test_time_to_adapter_runs_the_whole_pipeline(tiny_model_dir, monkeypatch, private_tempdir):
    from rlfleet.shared import allocator

    monkeypatch.delenv("REDIS_URL", raising=False)  # the embedded server, as a new user gets it
    # Two runs: the first run's held-out ratings stay pending, so fewer new ones start the second (the
    # benchmark used to wait for a run that had started before its clock did).
    # A user with 12 earlier ratings (a seeded v0001 trained on them), and time between the runs.
    figures = time_to_adapter.main(["--model", str(tiny_model_dir), "--threshold", "8", "--runs", "2",
                                    "--first-after", "0", "--timeout", "240", "--json", "--no-record",
                                    "--set", "steps=3", "--history", "12", "--between", "5"])
    first, second = figures["runs"]
    assert figures["settings"] == {"steps": "3"} and (figures["history"], figures["between"]) == (12, 5)
    # In the 5 s before run 2 the training worker pooled every earlier rating its reward model reads:
    # the 12 seeded ones and those run 1 consumed (none if it was refused), and the pending ones it had
    # seen (run 1's held-out ratings at least, which run 2 trains on; not run 2's last).
    consumed = first["ratings_used"] if first["outcome"] == "served" else 0
    assert 12 + consumed < second["reward_model_known"] <= 12 + consumed + second["ratings_used"]
    for n, run in enumerate((first, second), 2):
        assert run["outcome"] in ("served", "rejected", "succeeded")
        assert run["version"] == f"v000{n}" and run["steps"] == 3 and math.isfinite(run["seconds"])
        assert run["ratings_used"] >= 1
        assert "training" in run["phases"]  # the progress record was seen mid-run
        # the run's own clock beside the phases (its loop checks are on by default)
        assert run["precision"] in ("fp32", "bf16") and run["loop_seconds"] >= 0 and run["loop_checked"] > 0
        assert run["final_kl_seconds"] > 0
        # the training worker as `rlfleet up` starts it: on the allocator it preloads where there is one
        assert run["allocator"] == allocator.kind(allocator.library())
    assert list(private_tempdir.glob("rlfleet-*")) == []  # its data dir is gone with it


@pytest.mark.parametrize("args", [["--history", "-5"], ["--between", "-1"], ["--first-after", "-0.5"],
                                  ["--between", "nan"], ["--first-after", "inf"]])
def test_time_to_adapter_refuses_a_negative_history_or_gap_before_starting_anything(args, capsys):
    with pytest.raises(SystemExit):
        time_to_adapter.main([*args, "--no-record"])
    assert "--history, --first-after and --between take a number of 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["--runs", "0"], "--runs and --threshold take a number of 1 or more"),
    (["--threshold", "0"], "--runs and --threshold take a number of 1 or more"),
    (["--timeout", "0"], "--timeout takes a number of seconds above 0"),
    (["--timeout", "nan"], "--timeout takes a number of seconds above 0"),
])
def test_time_to_adapter_refuses_no_runs_threshold_or_time_before_starting_anything(args, said, capsys):
    with pytest.raises(SystemExit):
        time_to_adapter.main([*args, "--no-record"])
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["steps", "steps=0", "no_such_key=1"])
def test_time_to_adapter_refuses_a_setting_it_cannot_apply_before_starting_anything(setting, capsys):
    with pytest.raises(SystemExit):
        time_to_adapter.main(["--set", setting, "--no-record"])
    assert "--set" in capsys.readouterr().err


def test_time_to_adapter_spans_follow_the_phases_as_they_came():
    # "exploring" (between loading and reference) was once left out of a fixed list of names and its
    # time counted as loading's.
    phases = {"training": 9.0, "loading": 0.5, "exploring": 2.0, "reference": 7.5, "evaluating": 20.0}
    assert time_to_adapter.spans(phases, 30.0) == (
        "queued 0.5 · loading 1.5 · exploring 5.5 · reference 1.5 · training 11.0 · evaluating 10.0")
    assert time_to_adapter.spans({}, 3.0) == ""


def test_record_appends_a_dated_block_with_the_command(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nearlier text\n")
    monkeypatch.setattr("sys.argv", ["bench/train_step.py", "--model", "tiny"])
    record.append("`bench.x` · tiny", "| a |\n|---|\n| 1 |", results)
    record.append("`bench.x` · tiny", "| a |\n|---|\n| 2 |", results)
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nearlier text\n")
    assert text.count(record.APPENDED) == 1 and text.count("### `bench.x` · tiny · ") == 2
    assert "--model tiny" in text and text.index("| 1 |") < text.index("| 2 |")


def test_answer_while_training_times_answers_quiet_and_during_the_runs_steps(tiny_model_dir, monkeypatch,
                                                                            private_tempdir):
    monkeypatch.delenv("REDIS_URL", raising=False)  # the embedded server, as a new user gets it
    monkeypatch.setenv("RLFLEET_HOME", str(private_tempdir))  # the benchmark sets both: put back after
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    # a run far too long to end while the answers are drawn: each is timed inside its training phase.
    # One niceness (each is a round of its own workers: the loop over them adds nothing to test).
    figures = answer_while_training.main(["--model", str(tiny_model_dir), "--rounds", "1", "--answers", "2",
                                          "--nice", "5", "--threshold", "4", "--steps", "10000",
                                          "--timeout", "240", "--json", "--no-record"])
    assert [(r["round"], r["nice"]) for r in figures["rounds"]] == [(1, 5)]
    (r,) = figures["rounds"]
    assert [a["phase"] for a in r["quiet"]] == ["quiet"] * 2
    assert [a["phase"] for a in r["training"]] == ["training"] * 2
    assert all(a["seconds"] > 0 and a["tokens"] > 0 for a in r["quiet"] + r["training"])
    s = figures["summary"]["5"]
    assert s["answers"] == 2 and s["after"] == 0
    assert s["slowdown"] == pytest.approx(s["training_s"] / s["quiet_s"])
    assert "| 5 |" in answer_while_training.report(figures)
