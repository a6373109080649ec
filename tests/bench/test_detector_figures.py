"""Detector figures over many seeds (``make bench``): per detector and planted anomaly, the detection rate,
the delay from onset to the first firing, and false alarms per 100 clean steps; then every detector over the
real runs' recorded steps. Streams and definitions: tests/monitor/figures.py. No services are started.

``TEMPER_DETECTOR_SEEDS`` (default 100) sets the seeds per scenario (each seed: one anomaly stream and one
clean stream of 40 steps). ``TEMPER_DETECTOR_FIGURES`` names a JSON file to write the figures to.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.monitor import figures as F

pytestmark = pytest.mark.bench


def test_detector_figures():
    seeds = int(os.environ.get("TEMPER_DETECTOR_SEEDS", "100"))
    figs = [F.evaluate(s, seeds) for s in F.SCENARIOS]
    print(f"\ndetector figures: {seeds} seeds per scenario, {F.STEPS} steps per stream, onset in steps "
          f"{F.ONSET[0]}-{F.ONSET[1]}\n" + F.TABLE_HEADER)
    for f in figs:
        print(f.row())
    real = [r for name in sorted(F.REAL_RUNS) for r in F.replay_real(name)]
    print("\nreal runs (rule held at steps; '-' never; n/a: the series lacks what the rule reads)")
    for r in real:
        if r.readable or r.fired:
            print(f"| {r.run} | {r.detector} | {r.series} | {r.steps} | {r.fired or '-'} | "
                  f"{r.messages[0] if r.messages else ''} |")
    if os.environ.get("TEMPER_DETECTOR_FIGURES"):
        with open(os.environ["TEMPER_DETECTOR_FIGURES"], "w") as out:
            json.dump({"seeds": seeds, "scenarios": [
                {"detector": f.detector, "anomaly": f.anomaly, "detection_rate": f.detection_rate,
                 "mean_delay": f.mean_delay, "max_delay": f.max_delay, "false_alarms_per_100": f.false_alarms_per_100,
                 "clean_steps": f.clean_steps, "clean_streams_alarmed": f.clean_streams_alarmed} for f in figs],
                "real": [r.__dict__ for r in real]}, out, indent=1)
    for f in figs:  # the figures are the product; these bounds only catch a detector that stopped working
        assert f.detection_rate >= 0.8, f.row()
        assert f.false_alarms_per_100 <= 2.0, f.row()
