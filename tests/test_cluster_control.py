"""The rank-0 control channel over real loopback sockets: how a lost follower is detected."""

from __future__ import annotations

import asyncio
import json
import socket

from modal_rl.cluster.control import ControlClient, ControlServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


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
        assert await asyncio.to_thread(sock.recv, 10) == b""  # closed by rank 0: no such rank
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
