"""``mtune download``: fetch a model repository from the Hugging Face Hub into a local directory."""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

from mtune._cli.errors import CliError


def download_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mtune download",
        description="Download a model repository from the Hugging Face Hub (huggingface_hub.snapshot_download).",
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="e.g. meta-llama/Llama-3.2-1B-Instruct")
    parser.add_argument("--output-dir", help="where the files go (default: /tmp/<repo name>)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--allow-patterns", nargs="+", default=None, metavar="GLOB", help="only files matching these")
    parser.add_argument("--ignore-patterns", nargs="+", default=None, metavar="GLOB", help="skip files matching these")
    parser.add_argument("--hf-token", default=None, help="access token (default: $HF_TOKEN or `hf auth login`)")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir or f"/tmp/{args.repo_id.rstrip('/').split('/')[-1]}").expanduser().resolve()
    files = download(args.repo_id, output_dir, args.revision, args.allow_patterns, args.ignore_patterns, args.hf_token)
    print(f"downloaded {args.repo_id} to {output_dir} ({len(files)} files):")
    for name in files:
        print(f"  {name}")
    return 0


def download(repo_id, output_dir: Path, revision=None, allow_patterns=None, ignore_patterns=None, token=None):
    """Fetch ``repo_id`` into ``output_dir`` and return the repo files it holds; raise `CliError` on failure.

    File names from the hub that would land outside ``output_dir`` (``..``, absolute paths) are refused.
    """
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = token or os.environ.get("HF_TOKEN") or None  # None: huggingface_hub falls back to the saved login
    try:
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=output_dir,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            token=token,
        )
    except GatedRepoError:
        raise CliError(
            f"{repo_id} is gated: you must accept its licence before downloading",
            f"accept it at https://huggingface.co/{repo_id}, then pass --hf-token (or set HF_TOKEN)",
        ) from None
    except RevisionNotFoundError:
        raise CliError(f"{repo_id} has no revision '{revision}'", "check --revision (a branch, tag or commit)") from None
    except RepositoryNotFoundError:
        raise CliError(
            f"repository {repo_id} not found on the hub (or it is private)",
            "check the name (owner/name); for a private repo pass --hf-token",
        ) from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise CliError(
                f"access to {repo_id} was refused ({status}): it is gated or private",
                f"accept its licence at https://huggingface.co/{repo_id} and pass --hf-token (or set HF_TOKEN)",
            ) from None
        raise CliError(f"downloading {repo_id} failed: {str(err).splitlines()[0]}") from None
    except (LocalEntryNotFoundError, httpx.ConnectError, httpx.TimeoutException):
        raise CliError(
            f"cannot reach the hub to download {repo_id}",
            "check the network connection (and HF_ENDPOINT / proxy settings if you use them)",
        ) from None
    except ValueError as err:
        if "filename" in str(err).lower() or ".." in str(err):
            raise CliError(f"{repo_id} lists an unsafe file name; refused to write outside {output_dir}: {err}") from None
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise CliError(f"no space left on the device holding {output_dir}", "free some space or use --output-dir") from None
        raise CliError(f"cannot write to {output_dir}: {err.strerror or err}") from None
    return sorted(
        p.relative_to(output_dir).as_posix()
        for p in output_dir.rglob("*")
        if p.is_file() and ".cache" not in p.relative_to(output_dir).parts
    )
