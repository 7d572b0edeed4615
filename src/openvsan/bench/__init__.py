"""`vsan bench`: profiles (profiles.py), one asyncio worker (engine.py), the multi-process runner (runner.py),
the latency histogram (histogram.py), the --verify pattern (verify.py), reports (report.py, plots.py)."""
