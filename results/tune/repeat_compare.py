"""Measured A against measured B of the same bench_tuner configurations (one profile, so the same rates and
seeds, so the same requests at the same times): how far two measurements of one deployment agree, the
ceiling of any prediction made before the run. Usage: python results/tune/repeat_compare.py A.json B.json"""
import json
import sys
from pathlib import Path

a = json.loads(Path(sys.argv[1]).read_text())["rows"]
b = json.loads(Path(sys.argv[2]).read_text())["rows"]
keys = ["ttft_p50_ms", "tpot_p50_ms", "output_throughput_tok_s"]
ok_all = 0; per = {k: 0 for k in keys}
for ra, rb in zip(a, b):
    assert (ra["model"], ra["tp"], ra["pp"]) == (rb["model"], rb["tp"], rb["pp"]) and abs(ra["rate_req_s"] - rb["rate_req_s"]) < 1e-9
    errs = {k: rb["measured"][k] / ra["measured"][k] - 1 for k in keys}
    okk = {k: abs(v) <= 0.10 for k, v in errs.items()}
    for k in keys: per[k] += okk[k]
    ok_all += all(okk.values())
    print(f'{ra["model"]:10s} TP{ra["tp"]} PP{ra["pp"]} {ra["rate_req_s"]:6.2f} req/s: ' + "  ".join(
        f'{k.split("_")[0]} {ra["measured"][k]:8.2f} -> {rb["measured"][k]:8.2f} ({errs[k]*100:+.1f}%)' for k in keys))
print(f"B within 10% of A on all three: {ok_all}/{len(a)}; per metric " + ", ".join(f"{k} {v}/{len(a)}" for k, v in per.items()))
