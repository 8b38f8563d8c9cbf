"""The suite's xdist scheduler: real-server files go to one worker as one unit, long files first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.xdist_schedule import REAL_SERVERS, SuiteScheduling

FILES = {
    "test_small.py": "def test_a(): pass\n",
    "test_many.py": "# mentions pytest.mark.real_server without being marked\n",
    "test_long.py": "import pytest\npytestmark = pytest.mark.long\n",
    "test_server_a.py": "import pytest\npytestmark = [pytest.mark.slow, pytest.mark.real_server]\n",
    "test_server_b.py": "import pytest\npytestmark = pytest.mark.real_server\n",
}
COLLECTION = (
    ["test_small.py::test_a"]
    + [f"test_many.py::test_{i}" for i in range(6)]
    + ["test_server_a.py::test_x", "test_long.py::test_l", "test_server_b.py::test_y"]
)


class Node:
    """Stands in for xdist's WorkerController: records what it is sent."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices):
        self.sent.append(indices)

    def shutdown(self):
        self.shutting_down = True


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    config = SimpleNamespace(rootpath=tmp_path, option=SimpleNamespace(loadscopereorder=True))
    monkeypatch.setattr("xdist.scheduler.loadscope.parse_tx_spec_config", lambda config: ["popen"] * 2)
    return SuiteScheduling(config)


def test_real_server_files_are_one_unit_and_go_out_first(scheduler):
    nodes = [Node("gw0"), Node("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()

    first = {node.gateway.id: [COLLECTION[i] for i in node.sent[0]] for node in nodes}
    assert first["gw0"] == ["test_server_a.py::test_x", "test_server_b.py::test_y"]
    assert first["gw1"] == ["test_long.py::test_l"]
    assert scheduler._split_scope("test_server_b.py::test_y") == REAL_SERVERS
    assert scheduler._split_scope("test_many.py::test_0") == "test_many.py"
    # Then xdist's own order: the file with most tests.
    assert [COLLECTION[i] for i in nodes[0].sent[1]] == [f"test_many.py::test_{i}" for i in range(6)]
