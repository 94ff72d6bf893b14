"""Request validation of the retriever HTTP service (issue 14).

Every bad request must get a JSON error with the right status code, never a dropped or hung
connection, and the server must keep serving. The server runs in-process on 127.0.0.1 with an
ephemeral port; raw-socket requests use a short socket timeout so a hang fails the test instead of
blocking it.
"""
import http.client
import json
import math
import select
import socket
import threading
import time

import pytest

from emapg_megatron.tasks.retriever import (
    DEFAULT_MAX_TOPK,
    RequestError,
    RetrieverClient,
    RetrieverServer,
    check_topk,
    parse_retrieve_request,
)

pytestmark = pytest.mark.timeout(120)  # a hang guard only; the socket timeouts below fire first

SOCK_TIMEOUT = 5.0
GOOD = json.dumps({"queries": ["Red Planet"], "topk": 1}).encode()


@pytest.fixture(scope="module")
def server(retriever):
    with RetrieverServer(retriever, host="127.0.0.1", port=0) as srv:
        yield srv


def _post(srv, body: bytes, path: str = "/retrieve", conn=None):
    """POST with http.client (which sets a correct Content-Length); (status, json, conn)."""
    conn = conn or http.client.HTTPConnection("127.0.0.1", srv.port, timeout=SOCK_TIMEOUT)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, raw, closes = resp.status, resp.read(), resp.getheader("Connection", "")
    assert resp.getheader("Content-Type") == "application/json"
    return status, json.loads(raw), closes.lower() == "close", conn


def _get(srv, path):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=SOCK_TIMEOUT)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _assert_still_serves(srv):
    status, payload, _, conn = _post(srv, GOOD)
    conn.close()
    assert status == 200
    assert payload["result"][0][0]["document"]["title"] == "Mars"


def _read_response(sock):
    """Read one HTTP response from a raw socket: (status, headers, json body)."""
    buf = b""
    for _ in range(10000):  # bounded; each recv is bounded by the socket timeout
        if b"\r\n\r\n" in buf:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, sep, rest = buf.partition(b"\r\n\r\n")
    assert sep, f"no complete response head: {buf[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    n = int(headers["content-length"])
    for _ in range(10000):
        if len(rest) >= n:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    assert len(rest) >= n, "response body cut short"
    assert headers.get("content-type") == "application/json"
    return status, headers, json.loads(rest[:n])


def _raw(srv, head: str, body: bytes = b"", shut_write: bool = False):
    """Send a hand-written request; return (status, headers, json, closed) where ``closed`` says
    the server closed the connection after the reply (EOF instead of a timeout)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=SOCK_TIMEOUT) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n\r\n" + body)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        status, headers, payload = _read_response(sock)
        closed = False
        if headers.get("connection", "").lower() == "close":
            closed = sock.recv(1) == b""  # raises socket.timeout if the server hangs instead
        return status, headers, payload, closed


def _head(content_length=None, extra=(), path="/retrieve"):
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    lines.extend(extra)
    return "\r\n".join(lines)


# ----------------------------------------------------------------------------------------------
# topk


@pytest.mark.parametrize("topk_text", [
    "1e400", "-1e400", "NaN", "Infinity", "3.0", "2.5", "true", "false", "null", '"3"', "[3]",
    "0", "-1", str(DEFAULT_MAX_TOPK + 1), "1" + "0" * 40,
])
def test_bad_topk_is_a_400_and_the_server_keeps_serving(server, topk_text):
    body = ('{"queries": ["Mars"], "topk": %s}' % topk_text).encode()
    status, payload, closes, conn = _post(server, body)
    assert status == 400 and "'topk'" in payload["error"], payload
    assert not closes  # the body was read: the same connection serves the next request
    status, payload, _, conn = _post(server, GOOD, conn=conn)
    conn.close()
    assert status == 200 and payload["result"][0][0]["document"]["title"] == "Mars"


def test_topk_inf_message(server):
    status, payload, _, conn = _post(server, b'{"queries": ["Mars"], "topk": 1e400}')
    conn.close()
    assert status == 400
    assert payload["error"] == "'topk' must be an integer, got float inf"
    status, payload, _, conn = _post(server, b'{"queries": ["Mars"], "k": 101}')
    conn.close()
    assert status == 400 and payload["error"] == f"'topk' must be between 1 and {DEFAULT_MAX_TOPK}, got 101"
    _assert_still_serves(server)


def test_good_topk_values(server):
    for k in (1, 2, DEFAULT_MAX_TOPK):
        status, payload, _, conn = _post(server, json.dumps({"queries": ["Mount Fuji"], "topk": k}).encode())
        conn.close()
        assert status == 200 and 1 <= len(payload["result"][0]) <= min(k, 50)
    status, payload, _, conn = _post(server, b'{"queries": "Red Planet"}')  # default topk 3
    conn.close()
    assert status == 200 and payload["result"][0][0]["document"]["title"] == "Mars"


# ----------------------------------------------------------------------------------------------
# Content-Length and body size


def test_negative_content_length_is_a_400_not_a_hang(server):
    status, _, payload, closed = _raw(server, _head(-1), b'{"queries": ["Mars"]}')
    assert status == 400 and "Content-Length" in payload["error"] and "'-1'" in payload["error"]
    assert closed
    _assert_still_serves(server)


@pytest.mark.parametrize("value", ["abc", "+5", "5_0", "1.5", "0x10", "", "5 5"])
def test_malformed_content_length_is_a_400(server, value):
    status, _, payload, closed = _raw(server, _head(value), b"{}")
    assert status == 400 and "invalid Content-Length" in payload["error"], payload
    assert closed
    _assert_still_serves(server)


def test_conflicting_content_lengths_are_a_400(server):
    status, _, payload, closed = _raw(server, _head(2, ["Content-Length: 3"]), b"{}")
    assert status == 400 and "conflicting Content-Length" in payload["error"]
    assert closed
    _assert_still_serves(server)


def test_missing_content_length_is_a_411(server):
    status, _, payload, closed = _raw(server, _head(None), GOOD)
    assert status == 411 and "missing Content-Length" in payload["error"]
    assert closed
    status, _, payload, closed = _raw(server, _head(None, ["Transfer-Encoding: chunked"]),
                                      b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD))
    assert status == 411 and "Transfer-Encoding" in payload["error"]
    assert closed
    _assert_still_serves(server)


def test_oversized_content_length_is_a_413(server):
    declared = server.max_body + 1
    assert server.max_body == 1 << 20  # the default
    # part of the body is sent; the server answers without waiting for (or reading) the rest
    status, _, payload, closed = _raw(server, _head(declared), b"x" * 65536)
    assert status == 413 and "too large" in payload["error"] and str(server.max_body) in payload["error"]
    assert closed
    status, _, payload, closed = _raw(server, _head("9" * 200))  # no int() of huge strings
    assert status == 413 and closed
    status, _, payload, closed = _raw(server, _head("0" * 30 + "2"), b"{}")  # leading zeros: 2 bytes
    assert status == 400 and payload["error"] == "missing 'queries' (a list of query strings)"
    _assert_still_serves(server)


def test_oversized_body_with_expect_100_continue_is_refused_first(server):
    status, headers, payload, closed = _raw(server, _head(server.max_body + 1, ["Expect: 100-continue"]))
    assert status == 413 and "too large" in payload["error"] and closed
    _assert_still_serves(server)


def test_body_size_limit_is_configurable(retriever):
    with RetrieverServer(retriever, port=0, max_body=1024) as srv:
        body = json.dumps({"queries": ["Mars " * 300], "topk": 1}).encode()
        assert len(body) > 1024
        status, _, payload, closed = _raw(srv, _head(len(body)), body)  # the whole body is sent
        assert status == 413 and "1024" in payload["error"] and closed
        with pytest.raises(RuntimeError, match="413 request body too large"):
            RetrieverClient(srv.url, timeout=SOCK_TIMEOUT, retries=0).search("Mars " * 300, 1)
        _assert_still_serves(srv)
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_body"):
            RetrieverServer(retriever, port=0, max_body=bad)
    with pytest.raises(ValueError, match="max_topk"):
        RetrieverServer(retriever, port=0, max_topk=0)
    with pytest.raises(ValueError, match="request_timeout"):
        RetrieverServer(retriever, port=0, request_timeout=math.inf)


def test_short_body_is_a_400(server):
    status, _, payload, closed = _raw(server, _head(100), b'{"queries": ', shut_write=True)
    assert status == 400 and "ended after 12 of 100 bytes" in payload["error"]
    assert closed
    _assert_still_serves(server)


def test_stalled_body_is_a_408(retriever):
    # the client declares 100 bytes, sends 12 and waits: the server times out and answers
    with RetrieverServer(retriever, port=0, request_timeout=0.3) as srv:
        status, _, payload, closed = _raw(srv, _head(100), b'{"queries": ')
        assert status == 408 and "timed out" in payload["error"] and closed
        _assert_still_serves(srv)


def _new_handler_threads(before, wait_s=30.0):
    """Handler threads started since ``before`` still alive after at most ``wait_s`` (a hang guard,
    not a timing assertion)."""
    end = time.monotonic() + wait_s
    while True:
        alive = [t for t in threading.enumerate()
                 if t not in before and "process_request_thread" in t.name]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.05)


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_trickled_request_is_a_408_and_frees_its_thread(retriever, phase):
    """The timeout is a deadline for the whole request: one byte at a time, each well inside
    the timeout, still gets a 408 (a per-read timeout would wait for all of it and answer 200)."""
    request = (_head(len(GOOD)) + "\r\n\r\n").encode() + GOOD
    sent = 0 if phase == "headers" else request.index(b"\r\n\r\n") + 4
    before = set(threading.enumerate())
    with RetrieverServer(retriever, port=0, request_timeout=1.0) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=SOCK_TIMEOUT) as sock:
            sock.sendall(request[:sent])
            # ~0.05 s a byte: the whole request would take several timeouts
            while sent < len(request) and not select.select([sock], [], [], 0.05)[0]:
                sock.sendall(request[sent:sent + 1])
                sent += 1
            status, headers, payload = _read_response(sock)
            assert status == 408 and "timed out" in payload["error"], payload
            assert headers["connection"] == "close" and sock.recv(1) == b""
        assert sent < len(request)
        assert _new_handler_threads(before) == []
        _assert_still_serves(srv)


def test_idle_connection_is_closed_without_a_reply(retriever):
    with RetrieverServer(retriever, port=0, request_timeout=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=SOCK_TIMEOUT) as sock:
            assert sock.recv(1) == b""  # EOF, not a 408 nobody asked for


def test_many_concurrent_clients_without_retries(server):
    """64 clients connecting at once all get answers (the stdlib's listen backlog of 5 made the
    kernel reset some connections; the client's retries are off so none is hidden)."""
    n, rounds = 64, 2
    barrier = threading.Barrier(n)
    results = []

    def work():
        client = RetrieverClient(server.url, timeout=60, retries=0)
        barrier.wait()
        for _ in range(rounds):
            try:
                results.append(client.search("Red Planet", 1)[0]["title"])
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                results.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["Mars"] * (n * rounds)


# ----------------------------------------------------------------------------------------------
# queries and the rest of the body


@pytest.mark.parametrize("body, message", [
    (b"", "empty request body"),
    (b"  \n", "empty request body"),
    (b"{not json", "invalid JSON body"),
    (b'{"queries": ["\xff\xfe"]}', "invalid JSON body"),
    (b"[" * 100000, "invalid JSON body"),
    (b'["Mars"]', "must be a JSON object, got list"),
    (b"{}", "missing 'queries'"),
    (b'{"queries": null}', "'queries' must be a list of strings, got NoneType"),
    (b'{"queries": 5}', "'queries' must be a list of strings, got int"),
    (b'{"queries": {"q": "Mars"}}', "'queries' must be a list of strings, got dict"),
    (b'{"queries": []}', "'queries' is empty"),
    (b'{"queries": [""]}', "queries[0] is empty"),
    (b'{"queries": ["Mars", "  \\t"]}', "queries[1] is empty"),
    (b'{"queries": ["Mars", 7]}', "queries[1] must be a string, got int"),
    (b'{"queries": [["Mars"]]}', "queries[0] must be a string, got list"),
    (b'{"queries": ["Mars"], "return_scores": "false"}', "'return_scores' must be true or false"),
])
def test_bad_body_is_a_400(server, body, message):
    status, payload, closes, conn = _post(server, body)
    conn.close()
    assert status == 400 and message in payload["error"], payload
    assert not closes
    _assert_still_serves(server)


def test_query_length_and_count_caps(retriever, server):
    long_query = "Mars " * 2000  # 10000 characters > the default 8192
    status, payload, _, conn = _post(server, json.dumps({"queries": ["Mars", long_query]}).encode())
    conn.close()
    assert status == 400 and payload["error"] == "queries[1] is too long: 10000 > 8192 characters"
    with RetrieverServer(retriever, port=0, max_queries=2, max_query_chars=10, max_topk=5) as srv:
        ok = json.dumps({"queries": ["Mars", "Mount Fuji"], "topk": 5}).encode()
        status, payload, _, conn = _post(srv, ok)
        conn.close()
        assert status == 200 and len(payload["result"]) == 2
        for body, message in [({"queries": ["a", "b", "c"]}, "too many queries: 3 > 2"),
                              ({"queries": ["Red Planet!"]}, "queries[0] is too long: 11 > 10"),
                              ({"queries": ["Mars"], "topk": 6}, "between 1 and 5, got 6")]:
            status, payload, _, conn = _post(srv, json.dumps(body).encode())
            conn.close()
            assert status == 400 and message in payload["error"], payload
        status, health = _get(srv, "/health")
        assert status == 200 and health == {"ok": True, "passages": 50, "max_topk": 5, "max_queries": 2,
                          "max_query_chars": 10, "max_body": 1 << 20}
        _assert_still_serves(srv)


def test_return_scores_false(server):
    status, payload, _, conn = _post(server, b'{"queries": ["Red Planet"], "topk": 1, "return_scores": false}')
    conn.close()
    assert status == 200 and payload["result"][0][0]["title"] == "Mars"


# ----------------------------------------------------------------------------------------------
# paths, methods, protocol errors: JSON too


def test_unknown_post_path_is_a_404_and_closes(server):
    status, _, payload, closed = _raw(server, _head(len(GOOD), path="/nope"), GOOD)
    assert status == 404 and "not found" in payload["error"] and closed
    _assert_still_serves(server)


def test_unsupported_method_and_bad_request_line_get_json(server):
    status, _, payload, closed = _raw(server, "PUT /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 0")
    assert status == 501 and "Unsupported method" in payload["error"] and closed
    status, _, payload, closed = _raw(server, "GET /a b HTTP/1.1\r\nHost: x")
    assert status == 400 and "Bad request syntax" in payload["error"] and closed
    status, payload = _get(server, "/nope")
    assert status == 404 and "not found" in payload["error"]
    _assert_still_serves(server)


def test_many_bad_requests_on_one_connection_then_a_good_one(server):
    conn = None
    for body in [b'{"queries": ["Mars"], "topk": 1e400}', b'{"queries": 5}', b"{oops", b'{"queries": [""]}'] * 5:
        status, payload, closes, conn = _post(server, body, conn=conn)
        assert status == 400 and payload["error"] and not closes
    status, payload, _, conn = _post(server, GOOD, conn=conn)
    conn.close()
    assert status == 200 and payload["result"][0][0]["document"]["title"] == "Mars"


# ----------------------------------------------------------------------------------------------
# client side and the validators


def test_client_checks_k_and_reports_server_messages(server):
    client = RetrieverClient(server.url, timeout=SOCK_TIMEOUT, retries=0)
    for bad in (True, 0, -2, 1.5, 3.0, math.inf, math.nan, "3", None):
        with pytest.raises(ValueError, match="'topk'"):
            client.search("Mars", bad)
    np = pytest.importorskip("numpy")
    assert client.search("Red Planet", np.int64(1))[0]["title"] == "Mars"
    with pytest.raises(RuntimeError, match=r"400 'topk' must be between 1 and 100, got 101"):
        client.search("Mars", DEFAULT_MAX_TOPK + 1)
    with pytest.raises(RuntimeError, match=r"400 queries\[0\] is empty"):
        client.search("", 1)
    assert client.batch_search([], 1) == []
    assert [h["title"] for h in client.search("Red Planet", 1)] == ["Mars"]


def test_validators_directly():
    assert check_topk(5, 10) == 5 and check_topk(10**6) == 10**6
    for bad in (True, False, 2.0, math.inf, "2", None, 0, 11):
        with pytest.raises(RequestError) as e:
            check_topk(bad, 10)
        assert e.value.status == 400 and isinstance(e.value, ValueError)
    assert parse_retrieve_request({"queries": "Mars"}) == (["Mars"], 3, True)
    assert parse_retrieve_request({"queries": ["a", "b"], "k": 2, "return_scores": False}) == (["a", "b"], 2, False)
    with pytest.raises(RequestError, match="'topk'"):
        parse_retrieve_request({"queries": ["a"], "topk": None, "k": 2})  # topk wins over k


def test_corpus_line_nested_too_deep_is_skipped(tmp_path, caplog):
    """A hostile corpus line is a bad line like any other, not a RecursionError."""
    from emapg_megatron.tasks.retriever import load_corpus

    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": "1", "contents": '"Mars"\nThe Red Planet.'}) + "\n"
                    + '{"id": "2", "contents": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    assert [p["title"] for p in load_corpus(str(path))] == ["Mars"]
    assert "skipped 1 bad line(s)" in caplog.text and "line index 1" in caplog.text
