"""``mtune download``: fetch a model repository from the Hugging Face Hub into a local directory.

huggingface_hub is imported only when the command runs. Its failures become one `CliError` line naming the repo:
its own error classes (``huggingface_hub.errors``), ``OSError`` (disk full, permissions), and, as a last resort,
a transport error that huggingface_hub lets through (its HTTP client differs between releases: requests, httpx,
httpx2), recognised by the module it comes from rather than imported, since no declared dependency provides it.
"""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from mtune._cli.errors import CliError

# Top-level packages of the HTTP clients huggingface_hub has used; an exception from one of them is a transport error.
_TRANSPORT_PACKAGES = frozenset({"httpx", "httpx2", "httpcore", "httpcore2", "h11", "requests", "urllib3"})
_NETWORK_HINT = "check the network connection (and HF_ENDPOINT / proxy settings if you use them)"


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
    parser.add_argument("--hf-token", default=None,
                        help="access token (default: $HF_TOKEN, else the token saved by `hf auth login`)")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir or f"/tmp/{args.repo_id.rstrip('/').split('/')[-1]}").expanduser().resolve()
    files = download(args.repo_id, output_dir, args.revision, args.allow_patterns, args.ignore_patterns, args.hf_token)
    print(f"downloaded {args.repo_id} to {output_dir} ({len(files)} files):")
    for name in files:
        print(f"  {name}")
    return 0


def download(repo_id, output_dir: Path, revision=None, allow_patterns=None, ignore_patterns=None, token=None):
    """Fetch ``repo_id`` into ``output_dir`` and return the repo files it holds; raise `CliError` on failure.

    ``token=None`` lets huggingface_hub find one itself (``HF_TOKEN``, then the saved login). File names from the
    hub that would land outside ``output_dir`` (``..``, absolute paths) are refused.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        if output_dir.is_dir() and any(output_dir.iterdir()):
            _check_reachable(repo_id, revision, token, output_dir)
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=output_dir,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            token=token,
        )
    except GatedRepoError as err:
        raise CliError(
            f"{repo_id} is gated: you must accept its licence before downloading",
            f"accept it at https://huggingface.co/{repo_id}, then set HF_TOKEN (or pass --hf-token)",
        ) from err
    except RevisionNotFoundError as err:
        raise CliError(f"{repo_id} has no revision '{revision}'", "check --revision (a branch, tag or commit)") from err
    except RepositoryNotFoundError as err:
        raise CliError(
            f"repository {repo_id} not found on the hub (or it is private)",
            "check the name (owner/name); for a private repo set HF_TOKEN (or pass --hf-token)",
        ) from err
    except HfHubHTTPError as err:
        response = getattr(err, "response", None)
        status = getattr(response, "status_code", None)
        if status in (401, 403):
            raise CliError(
                f"access to {repo_id} was refused ({status}): it is gated or private",
                f"accept its licence at https://huggingface.co/{repo_id}, then set HF_TOKEN (or pass --hf-token)",
            ) from err
        raise CliError(f"downloading {repo_id} failed: {_first_line(err)}") from err
    except LocalEntryNotFoundError as err:  # raised when the hub cannot be reached and nothing is cached
        reason = f": {_first_line(err.__cause__)}" if err.__cause__ is not None else ""
        raise CliError(f"cannot reach the hub at {constants.ENDPOINT} to download {repo_id}{reason}",
                       _NETWORK_HINT) from err
    except HFValidationError as err:
        raise CliError(f"'{repo_id}' is not a valid repository id: {_first_line(err)}",
                       "write it as owner/name, e.g. meta-llama/Llama-3.2-1B-Instruct") from err
    except ValueError as err:
        if "filename" in str(err).lower() or ".." in str(err):
            raise CliError(f"{repo_id} lists an unsafe file name; refused to write outside {output_dir}: "
                           f"{_first_line(err)}") from err
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise CliError(f"no space left on the device holding {output_dir} while downloading {repo_id}",
                           "free some space or choose another --output-dir") from err
        if err.filename is not None or err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CliError(f"cannot write {repo_id} to {output_dir}: {err.strerror or _first_line(err)}",
                           "choose another --output-dir") from err
        raise CliError(f"downloading {repo_id} from {constants.ENDPOINT} failed: {_first_line(err)}",
                       _NETWORK_HINT) from err  # e.g. requests' network errors, which are OSErrors
    except Exception as err:
        if not _is_transport_error(err):
            raise
        raise CliError(f"downloading {repo_id} from {constants.ENDPOINT} failed: {type(err).__name__}: "
                       f"{_first_line(err)}", _NETWORK_HINT) from err
    return sorted(
        p.relative_to(output_dir).as_posix()
        for p in output_dir.rglob("*")
        if p.is_file() and ".cache" not in p.relative_to(output_dir).parts
    )


def _check_reachable(repo_id, revision, token, output_dir: Path) -> None:
    """Ask the hub for ``repo_id`` before downloading into a directory that already holds files: when the hub cannot
    be reached, snapshot_download returns such a directory as it is, with a warning only, and the command would
    report its old files as downloaded. The hub's own errors (missing, gated, bad revision) go to the caller."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().model_info(repo_id, revision=revision or constants.DEFAULT_REVISION, token=token)
    except HfHubHTTPError:
        raise
    except Exception as err:
        if not (isinstance(err, OSError) or _is_transport_error(err)):
            raise
        raise CliError(f"cannot reach the hub at {constants.ENDPOINT} to download {repo_id}: {_first_line(err)} "
                       f"(the files already in {output_dir} were left as they are)", _NETWORK_HINT) from err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _is_transport_error(err: BaseException) -> bool:
    return any(cls.__module__.split(".")[0] in _TRANSPORT_PACKAGES for cls in type(err).__mro__)
