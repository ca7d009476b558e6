"""A serving process's frozen startup heap (``frozen_heap``): out of collections while
frozen, collected again once unfrozen. Its own module: ``test_server``'s in-process server
freezes this process's heap while that module runs, and an unfreeze releases it all."""

import gc
import weakref

from tokenspeed.server.frozen_heap import frozen_heap


def test_a_frozen_heap_is_collected_again_once_unfrozen():
    class Node:
        pass
    node = Node()
    node.me, alive = node, weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None       # a cycle frozen before the block: not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
