"""The decoding measurements: times per layout and context, their tables, the intensity table, the command."""

import matplotlib

matplotlib.use("Agg")

from mha_lab.analysis import MODEL_CONFIGS  # noqa: E402
from mha_lab.plots import decode  # noqa: E402

KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}


def test_decode_times_has_one_time_per_layout_and_context():
    times = decode.decode_times([8, 64], d_model=32, n_heads=4, kv_heads=KV_HEADS, repeat=2)
    assert set(times) == set(KV_HEADS) and all(len(t) == 2 and min(t) > 0 for t in times.values())
    table = decode.decode_times_table([8, 64], times, 32, 4, KV_HEADS)
    assert table.splitlines()[0].startswith("| context | MHA: ms (GB/s) | GQA: ms (GB/s) | MQA: ms (GB/s) | MHA / GQA")
    assert len(table.splitlines()) == 4
    fig = decode.plot_decode_times([8, 64], times, 32, 4)
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel() and len(ax.lines) == 3


def test_intensity_table_shows_2_h_over_g_bytes_for_the_attention():
    table = decode.intensity_table([MODEL_CONFIGS["Llama-2-7B"], MODEL_CONFIGS["Llama-3-8B"]], 4096, (1, 64))
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert [r[-1].strip() for r in rows] == ["1", "1", "4", "4"]  # float16: 2 (h / g) / 2
    whole = [float(r[-2]) for r in rows]
    assert whole[1] > whole[0] and whole[3] > whole[2]  # batching amortises the weights


def test_the_command_prints_both_tables(capsys):
    assert decode.main(["--contexts", "8", "16", "--d-model", "32", "--heads", "4", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "| context |" in out and "FLOPs / byte" in out and "Ridge point" in out
    assert "MHA (1), GQA with 8 K/V heads (16) and MQA (129) are below the ridge: memory-bound" in out
    assert "MLA absorbed (242) is within a factor of 2 of it: neither bound dominates" in out
