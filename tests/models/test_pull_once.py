"""Processes that pull the same model at once download and convert it once."""

from __future__ import annotations

import threading
import time

import dspark.models.pull as pull


def test_concurrent_pulls_convert_once_and_all_get_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    conversions = []

    def fake_download(spec, tmp, progress):
        return tmp / "model.gguf"

    def slow_convert(gguf, out, spec):
        conversions.append(out)
        time.sleep(0.3)  # a second pull arrives while this one is converting
        out.mkdir(parents=True)
        (out / pull.READY_MARKER).write_text("{}")

    monkeypatch.setattr(pull, "_download_gguf", fake_download)
    monkeypatch.setattr(pull, "_verify_sha256", lambda gguf, sha, progress: None)
    monkeypatch.setattr(pull, "_convert_gguf", slow_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(pull.pull_model("smollm2-135m", progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(conversions) == 1
    assert len(results) == 3 and all((r / pull.READY_MARKER).is_file() for r in results)
