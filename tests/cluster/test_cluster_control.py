"""The rank-0 control channel over real loopback sockets: how a lost follower is detected."""

from __future__ import annotations

import asyncio
import json
import socket

from modal_rl.cluster.control import ControlClient, ControlServer, hello_proof
from modal_rl.cluster.ports import reserve


def _free_port() -> int:
    return reserve(1, "127.0.0.2")[0]


async def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_closed_connection_silence_and_dead_ray_node_are_each_reported_with_the_rank():
    async def scenario():
        port = _free_port()
        server = ControlServer(nodes=4, lost_after_s=0.5)
        await server.start("127.0.0.2", port)
        clients = {}
        for rank in (1, 2, 3):
            clients[rank] = await asyncio.to_thread(ControlClient, "127.0.0.2", port, rank, 5.0, 0.1)
        await _wait_for(lambda: all(s.connected_at for s in server.followers.values()))
        clients[1].send({"log": "loading shard 3"})
        clients[1].send({"log": "segfault in worker"})
        await _wait_for(lambda: len(server.followers[1].lines) == 2)
        assert server.failures() == []

        clients[1].sock.close()  # rank 1's process dies: its socket closes
        clients[1].broken.set()
        await _wait_for(lambda: server.followers[1].lost is not None, 2.0)
        assert "control connection closed" in server.followers[1].lost
        assert "[rank 1] segfault in worker" in server.followers[1].tail()

        clients[2].broken.set()  # rank 2 hangs: connection open, heartbeats stop
        await _wait_for(lambda: any(s.rank == 2 for s in server.failures()), 3.0)
        assert server.followers[2].lost.startswith("no heartbeat for")

        clients[3].send({"ray_exited": -9})
        await _wait_for(lambda: server.followers[3].lost is not None)
        assert server.followers[3].lost == "its Ray node exited with code -9"

        # A healthy follower receives "head up" even if it connects after it was announced.
        await server.announce_head_up()
        server.followers[3].lost = None
        late = await asyncio.to_thread(ControlClient, "127.0.0.2", port, 3, 5.0, 0.1)
        assert await asyncio.to_thread(late.poll, 3.0) == {"head_up": True}
        await server.release(0)
        assert await asyncio.to_thread(late.poll, 3.0) == {"exit": 0}
        for client in (*clients.values(), late):
            client.close()

    asyncio.run(scenario())


def test_unknown_rank_is_dropped_and_client_gives_up_on_a_dead_port():
    async def scenario():
        port = _free_port()
        server = ControlServer(nodes=2, lost_after_s=5)
        await server.start("127.0.0.2", port)
        sock = socket.create_connection(("127.0.0.2", port))
        sock.sendall((json.dumps({"hello": 7}) + "\n").encode())
        sock.settimeout(3)
        got = await asyncio.to_thread(_read_to_eof, sock)
        assert got.startswith(b'{"challenge"') and got.count(b"\n") == 1  # then closed: no such rank
        sock.close()
        assert server.failures() == []
        await server.release(0)

    asyncio.run(scenario())
    try:
        ControlClient("127.0.0.2", _free_port(), 1, connect_timeout_s=0.5)
    except ConnectionError as exc:
        assert "rank 1: could not reach rank 0's control port" in str(exc)
    else:
        raise AssertionError("connected to a port nobody listens on")


def _read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_a_follower_must_prove_the_run_key_before_it_counts():
    """Only a hello with a valid proof for this challenge makes a follower; a keyless client,
    a wrong key and a replayed proof are dropped and can report nothing."""

    async def scenario():
        port = _free_port()
        server = ControlServer(nodes=2, lost_after_s=5, key="run-key-A")
        await server.start("127.0.0.2", port)
        for key in (None, "run-key-B"):
            client = await asyncio.to_thread(ControlClient, "127.0.0.2", port, 1, 5.0, 0.1, key)
            client.send({"ray_exited": 9})
            assert await asyncio.to_thread(client.poll, 3.0) is False  # dropped: connection closed
            client.close()
        # A proof recorded for an earlier challenge does not fit a new one.
        sock = socket.create_connection(("127.0.0.2", port))
        sock.settimeout(3)
        first = json.loads(await asyncio.to_thread(sock.makefile().readline))
        stale = hello_proof("run-key-A", "0" * 32, 1)
        assert first["challenge"] != "0" * 32
        sock.sendall((json.dumps({"hello": 1, "proof": stale}) + "\n").encode())
        assert await asyncio.to_thread(_read_to_eof, sock) == b""
        sock.close()
        await _wait_for(lambda: server.refused == 3)
        assert server.followers[1].connected_at is None and server.failures() == []

        good = await asyncio.to_thread(ControlClient, "127.0.0.2", port, 1, 5.0, 0.1, "run-key-A")
        await _wait_for(lambda: server.followers[1].connected_at is not None)
        good.send({"log": "hello from rank 1"})
        await _wait_for(lambda: list(server.followers[1].lines) == ["hello from rank 1"])
        await server.release(0)
        assert await asyncio.to_thread(good.poll, 3.0) == {"exit": 0}
        good.close()

    asyncio.run(scenario())
