"""asyncio actor runtime on the ZeroMQ transport. Knows nothing of models or RL."""
from replayrl.actors.actor import Actor, ActorServer, concurrent
from replayrl.actors.directory import Directory
from replayrl.actors.errors import (
    ActorCallError,
    ActorDied,
    ActorError,
    ActorTimeout,
    ProtocolError,
    RemoteError,
    UnknownActor,
)
from replayrl.actors.interface import ActorInterface
from replayrl.actors.loop import run_event_loop
from replayrl.actors.proxy import ActorProxy
from replayrl.actors.ref import ActorRef, close_connections, send_buffer
from replayrl.actors.spawn import (
    DRIVER,
    ActorSpec,
    DriverActors,
    Supervisor,
    import_callable,
    import_object,
    process_groups,
    serve_actor,
    serve_actors,
)

__all__ = [
    "Actor", "ActorServer", "concurrent", "Directory", "UnknownActor", "ActorDied", "ActorError",
    "ActorTimeout", "ProtocolError", "RemoteError", "run_event_loop", "ActorRef",
    "close_connections", "send_buffer", "ActorCallError", "ActorInterface", "ActorProxy", "ActorSpec", "Supervisor",
    "DRIVER", "DriverActors", "import_callable", "import_object", "serve_actor", "serve_actors", "process_groups",
]
