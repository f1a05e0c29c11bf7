"""mtune.units: the one byte-size parser (``mtune plan --device-memory`` and ``max_shard_size`` both read it) and the
one printer, with exact values."""

import pytest

from mtune.errors import MtuneError
from mtune.units import GIB, MIB, SizeError, format_bytes, parse_budget, parse_bytes


def test_binary_units():
    assert (MIB, GIB) == (1048576, 1073741824)


@pytest.mark.parametrize("text, expected", [
    # mtune plan's spellings
    ("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512", 512), ("512MiB", 512 * 2**20), ("1.5TB", 1_500_000_000_000),
    ("2TiB", 2 * 2**40), (".5GiB", 2**29), ("7k", 7000), ("3m", 3_000_000), ("2g", 2_000_000_000), ("1t", 10**12),
    (" 8 gib ", 8 * 2**30), ("100b", 100), ("1kib", 1024),
    # max_shard_size's spellings (Hugging Face's: GB decimal, GiB binary)
    ("5GB", 5_000_000_000), ("500MB", 500_000_000), ("2GiB", 2 * 2**30), ("600KB", 600_000), ("16MB", 16_000_000),
    ("1000GB", 10**12), ("1.5GB", 1_500_000_000), ("1 KiB", 1024), ("64B", 64), ("5gb", 5_000_000_000),
    # ints are bytes already
    (4096, 4096), (0, 0),
    # a fraction of a byte is dropped
    ("1.5B", 1), ("0.001KB", 1),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "5XB", "5 G B", "GB", "", "-1GB", "5.GB", "1e9"])
def test_not_a_size_names_the_flag(text):
    with pytest.raises(SizeError) as err:
        parse_bytes(text, "--device-memory")
    assert str(err.value) == f"--device-memory={text!r}: write a size such as 24GiB, 80GB or 512MiB"
    assert isinstance(err.value, MtuneError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * 2**30), ("1MiB", 2**20), (2**20, 2**20), ("0.5GB", 5 * 10**8)])
def test_a_budget_is_a_size_with_its_unit(text, expected):
    assert parse_budget(text, "--device-memory") == expected


@pytest.mark.parametrize("text, message", [
    ("24", "--device-memory='24' has no unit: write 24GiB, 24GB or 24MiB (a bare number would be bytes)"),
    (" 80 ", "--device-memory=' 80 ' has no unit: write 80GiB, 80GB or 80MiB (a bare number would be bytes)"),
    ("0GiB", "--device-memory='0GiB' is 0 bytes, less than any run needs: write a size such as 24GiB (an int is bytes)"),
    ("1023KiB", "--device-memory='1023KiB' is 1047552 bytes, less than any run needs: write a size such as 24GiB (an "
                "int is bytes)"),
    (24, "--device-memory=24 is 24 bytes, less than any run needs: write a size such as 24GiB (an int is bytes)"),
    ("lots", "--device-memory='lots': write a size such as 24GiB, 80GB or 512MiB"),
])
def test_a_budget_without_its_unit_or_under_a_mib_is_refused(text, message):
    """`--device-memory 24` meant 24 GiB: as bytes it made a 90-second --fit search answer "nothing fits in 0.0 MiB"
    and a run start and fail in its first step."""
    with pytest.raises(SizeError) as err:
        parse_budget(text, "--device-memory")
    assert str(err.value) == message


@pytest.mark.parametrize("n, text", [
    (0, "0.0 MiB"), (512 * 2**20, "512.0 MiB"), (GIB - 1, "1024.0 MiB"), (GIB, "1.00 GiB"), (1.5 * GIB, "1.50 GiB"),
    (80 * 10**9, "74.51 GiB"), (-2 * GIB, "-2.00 GiB"), (-MIB, "-1.0 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
