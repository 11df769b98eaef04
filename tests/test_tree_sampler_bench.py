"""Smoke test of benchmarks.tree_sampler: the small configuration's code path on a tiny C."""

import json

from benchmarks import tree_sampler


def test_tree_sampler_benchmark_rows_and_json(tmp_path):
  payload = tree_sampler.run("small", out_dir=str(tmp_path), cs=(200,))  # 2000 points
  saved = json.loads((tmp_path / "tree_sampler.json").read_text())
  assert saved["benchmark"] == "tree_sampler" and saved["size"] == "small"
  assert saved["config"]["cs"] == [200] and saved["config"]["reps"] >= 10
  assert "load_average" in saved["machine"] and "cpu" in saved["machine"]
  assert not any("partial" in n for n in saved["notes"])
  assert len(saved["results"]) == len(payload["results"]) == 1
  for row, c in zip(saved["results"], (200,)):
    assert set(tree_sampler.COLUMNS) <= set(row), set(tree_sampler.COLUMNS) - set(row)
    assert row["C"] == c and row["N"] == tree_sampler.POINTS_PER_LABEL * c and row["k"] == 16
    assert row["depth"] == (c - 1).bit_length() == len(row["rounds_per_level"])
    assert all(row["levels_converged"]) and row["unconverged_levels"] == 0
    assert row["fit_s"] > 0 and row["fit_cpu_s"] > 0 and row["fit_peak_rss_bytes"] > 0
    assert row["samples_per_s"] > 0 and row["log_prob_all_queries_per_s"] > 0
    assert row["sample_queries"] == 1024 and row["sample_draws"] == 64
    # The planted hierarchy is learnable: the fitted tree beats the uniform distribution.
    assert row["test_log_lik"] > row["uniform_log_lik"] + 1.0, row
