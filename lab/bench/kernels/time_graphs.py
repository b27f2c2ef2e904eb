"""Median and best time of graphs written by variants.py, run in turn (2 threads, as the engine:
no spinning unless --spinning). `python lab/bench/kernels/time_graphs.py [--spinning] A.onnx ...`"""
import sys
import time

import numpy as np
import onnxruntime as ort

spinning = "--spinning" in sys.argv
paths = [a for a in sys.argv[1:] if a != "--spinning"]
so = ort.SessionOptions()
so.intra_op_num_threads = 2
so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
sessions = {p: ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]) for p in paths}
rng = np.random.default_rng(0)
feeds = {p: {i.name: rng.standard_normal(i.shape, dtype=np.float32) for i in s.get_inputs()}
         for p, s in sessions.items()}
took = {p: [] for p in paths}
for r in range(24):
    for p, s in sessions.items():
        t = time.perf_counter()
        s.run(None, feeds[p])
        if r >= 3:
            took[p].append(time.perf_counter() - t)
for p in paths:
    print(f"{p}: median {np.median(took[p]) * 1e3:.1f} ms, best {min(took[p]) * 1e3:.1f} ms "
          f"(21 runs, spinning {'on' if spinning else 'off'})")
