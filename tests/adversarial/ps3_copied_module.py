"""Take chunked_attention's answer from a copy of the package's module under another name: shutil.copy of
mha_lab/cpu/memory.py into the scratch folder, import my_tiles, return my_tiles.chunked_attention(...). No
reader of the notebook's text sees either name.

Stopped by: the sandbox holds the student's environment only: there is no mha_lab file to copy, so the call fails
and says so. It deserves nothing.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import importlib
    import shutil
    import sys
    from pathlib import Path

    def chunked_attention(Q, K, V, block_size, causal=False):
        if "my_tiles" not in sys.modules:  # found where the course's package is installed, copied under a new name
            places = [Path(repo), *(Path(p).parent for p in sys.path)]
            source = next((p / "mha_lab" / "cpu" / "memory.py" for p in places
                           if (p / "mha_lab" / "cpu" / "memory.py").is_file()), Path(repo) / "mha_lab/cpu/memory.py")
            shutil.copy(source, "my_tiles.py")
            sys.path.insert(0, ".")
            importlib.invalidate_caches()
        import my_tiles

        return my_tiles.chunked_attention(Q, K, V, causal=causal, block_q=block_size, block_k=block_size)
