"""``python -m mesh.reference > docs/topology-reference.md``: every key a topology takes, from the schema.

For a contributor, not a run: the page is generated so that it cannot drift from the schema, and
``tests/test_docs.py`` fails when the committed page differs. How a key's description is found is
``mesh/topology/reference_page.py``.
"""

from mesh.topology.reference_page import page

if __name__ == "__main__":
    print(page(), end="")
