from bk.util import free_port


def test_free_port_never_hands_out_a_port_twice():
    # The kernel may return a just-released ephemeral port at once; two bookies of
    # one local cluster given the same port made one fail at start.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
