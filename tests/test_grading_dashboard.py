"""A grading run starts no Dask dashboard unless asked (``--dashboard``): none is served, no port of the machine is
taken, a taken :8787 (another cluster's dashboard) brings no warning, and no worker runs the profiler that only the
dashboard shows."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
import warnings

import pytest

from mha_lab.grading import batch


@pytest.mark.timeout(120)
def test_no_dashboard_and_no_warning_when_its_port_is_taken():
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 8787))
        taken.listen()
    except OSError:
        pass  # taken already: the case this test is about
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with batch.dask_client(1) as client:
                assert client.submit(sum, [1, 2]).result() == 3
                server = client.cluster.scheduler.http_server
                assert server.address == "127.0.0.1" and server.port != 8787, (server.address, server.port)
                try:
                    reply = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status", timeout=10).status
                except urllib.error.HTTPError as exc:
                    reply = exc.code
                assert reply == 404, "the scheduler serves Dask's dashboard though none was asked for"
                profiling = client.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks)
                assert list(profiling.values()) == [False], "a worker samples its thread for a dashboard nobody sees"
    finally:
        taken.close()
    said = [str(w.message) for w in caught if "already in use" in str(w.message)]
    assert not said, said


def test_the_grade_command_offers_the_dashboard(capsys):
    from mha_lab.instructor import grade

    with pytest.raises(SystemExit):
        grade.main(["--help"])
    assert "--dashboard" in capsys.readouterr().out
