"""The storage layer: checkpoint files on a local disk or on object storage, read the same way.

One module per responsibility, each importing only those before it (and :mod:`ckptdoctor.errors`):

- :mod:`.interface`: what a remote backend answers (list, stat, ranged read), the shared part of the backends
  (listing cache, retries, error wording, transfer counts) and the one store per backend in a process;
- :mod:`.fsspec_store`, :mod:`.msc_store`: the backends (``s3://``, ``gs://``, ... through fsspec;
  ``msc://profile/path`` through multi-storage-client), whose client libraries are imported only when used;
- :mod:`.ranges`: byte ranges of one object, coalesced and fetched ahead concurrently;
- :mod:`.remote`: :class:`~.remote.RemotePath`, a URL that answers what readers ask of a ``pathlib.Path``, and
  the seekable file over ranged reads it opens;
- :mod:`.files`: every open and listing of a checkpoint's files (regular files only, bounded reads), local or
  remote;
- :mod:`.stream`: many byte ranges of many files read front to back in bounded windows (``--deep``);
- :mod:`.dispatch`: :func:`~.dispatch.as_path`, the one place a user's string becomes a local path or a URL's
  remote path on the backend its scheme names.

Writes are local only; the refusal of a remote target is the primitive :mod:`ckptdoctor.write_guard`.
"""
