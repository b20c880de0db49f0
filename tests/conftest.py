"""Suite-wide collection order.

``scripts/test.sh`` runs the suite on several pytest-xdist workers, one test
module at a time per worker (``--dist loadfile``), taking modules in collection
order. Modules marked ``slow`` (Spark, namespace hosts: the longest) are put
first, so that no worker starts one of them while the others are running out of
work; the order inside a module, and of everything else, stays as collected.
"""


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
