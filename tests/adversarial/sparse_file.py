"""A 250 MiB sparse file of zeros beside the notebook (a few KiB on disk), under the 256 MiB cap of a submission.

Stopped by: a file with holes travels as its data regions, and is copied with its holes: it costs the client, the
worker and the disk next to nothing, and the client holds at most two packed submissions per worker.
"""


def prepare(folder, nb, target):
    with open(folder / "zeros.bin", "wb") as f:
        f.truncate(250 * 2**20)


def cell(marker, port, course, repo, protect):
    pass
