"""Versioned, checksummed weight sync from the trainer to its followers, by placement.

Three transports, one record and one follower API (``WeightFollower.hold`` /
``check_intact``), chosen by :func:`choose_transport` from where the trainer and its
followers run:

- ``shm`` (same host, CPU): a ring of slot files in ``/dev/shm``; followers map them and
  adopt zero-copy views, verified in the background before any sample leaves.
- ``rdma`` (across hosts): the same slots registered as ``monarch.rdma.RDMABuffer``;
  followers pull a version into a spare buffer and verify it before swapping to it.
- ``cuda_ipc`` (same host, GPUs): the slots live on the trainer's GPU; followers open
  them through CUDA IPC handles, like ``shm`` but without leaving device memory.

Each transport is one slot backend behind one interface (``transports/``), chosen once
by its name; the rest is shared by all three. A follower never samples with weights that
are stale (another version) or torn (changed, corrupt or half-written): see ``slot.py``
for the slot's header and seqlock, ``checksum.py`` for the checksums and ``store.py`` for
the publisher and the parts. Each version's checksum also covers the store's manifest
(``manifest.py``), so a layout changed after publishing is refused like changed bytes,
before any view is built.

The store directory (``storedir.py``) is created exclusively under an unguessable name,
mode 0700; the publisher and every follower check its owner and mode when they open it
and never follow a link inside it, so another local user can neither plant the files a
follower reads nor redirect the publisher's writes. Trainer rank 0 (``actors/trainer/actor.py``),
not the publisher, owns the directory's life, on its own host:

    reclaim_dead_stores(root)       # as it starts: stores that dead trainers on this host left behind
    store = create_store(root)      # root: config.store_root()
    ...                             # WeightPublisher(store, ...)
    remove_store(store)             # in __cleanup__, when the run stops the trainer
"""
