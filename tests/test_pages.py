"""pages.page_out: the pages of a file-backed tensor go back to the file, its values stay."""

import os
import sys

import pytest
import torch

from dflash.engine import pages


def _resident_kb(path: str) -> int:
    """This process's resident kB of the mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                inside = head[-1] == path
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_page_out_hands_a_mapped_tensors_pages_back_and_keeps_its_values(tmp_path):
    path = str(tmp_path / "weights.bin")
    values = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MiB
    values.numpy().tofile(path)
    mapped = torch.from_file(path, shared=False, size=values.numel())  # as safetensors maps weights
    assert torch.equal(mapped, values)  # every page read
    read = _resident_kb(path)
    assert read > 12 << 10
    advised = pages.page_out([mapped])
    assert advised >= (16 << 20) - 2 * os.sysconf("SC_PAGE_SIZE")
    assert _resident_kb(path) < read // 4
    assert torch.equal(mapped, values)  # read back from the file
