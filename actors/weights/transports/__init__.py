"""Weight transports: one slot backend each, behind one interface, chosen once by name.

A transport decides where a store's ring of slots lives and how a follower reaches it;
everything else is shared: the slot's header and seqlock (``slot.py``), the checksums
(``checksum.py``), the manifest (``manifest.py``), the publisher's copy-and-hash
(``store.py``)::

    WeightPublisher ──create(store)─▶ SlotBackend ◀──attach(record)── WeightFollower
      writes each version into        shm       files in the store directory, mapped in place
      slot v % slots (seqlock,        cuda_ipc  GPU memory, opened in place through CUDA IPC handles
      checksum), returns its          rdma      registered memory, pulled into a private copy
      WeightVersion (+ handle)

``shm`` and ``cuda_ipc`` share the follower that opens the slots where they are
(``in_place.WeightSubscriber``); ``rdma``'s follower pulls a copy (``rdma.RdmaReceiver``).
The table in ``backend.py`` holds import paths, as ``actors/registry.py`` does: the backends
import ``backend.py`` for the interface and the shared follower looks its backend up by name, so a
table of imported classes there would make an import circle.
"""
