"""`DeviceStreams` ([Note: streams and events]) against a stand-in for `torch.cuda`'s stream API,
which records what a real device would be told: side streams are made with high priority, a
launched collective's work is waited for inside its stream (a stream wait, never the host), later
users wait for that stream's event, and a buffer released to a side stream is freed only after
that stream waited for the consumer's event."""

from __future__ import annotations

import contextlib

import torch

from veragged.runtime.streams import DeviceStreams


class FakeStream:
    def __init__(self, log, name, priority=0):
        self.log, self.name, self.priority = log, name, priority

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class FakeEvent:
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.log, self.name = log, f"e{FakeEvent.count}"

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))


class FakeModule:
    """The parts of `torch.cuda` DeviceStreams uses."""

    def __init__(self):
        self.log: list = []
        self.default = FakeStream(self.log, "default")
        self.stack = [self.default]
        self._n = 0

    def Stream(self, priority=0):
        self._n += 1
        return FakeStream(self.log, f"side{self._n}", priority)

    def Event(self):
        return FakeEvent(self.log)

    def current_stream(self, device=None):
        return self.stack[-1]

    @contextlib.contextmanager
    def device(self, device):
        yield

    @contextlib.contextmanager
    def stream(self, s):
        self.stack.append(s)
        try:
            yield
        finally:
            self.stack.pop()


class FakeWork:
    def __init__(self, module):
        self.module = module

    def wait(self):
        self.module.log.append(("work.wait", self.module.current_stream().name))


def test_device_streams_order_by_events_only():
    mod = FakeModule()
    rt = DeviceStreams(torch.device("cpu"), module=mod)
    ag = rt.stream("all_gather")
    assert ag.priority == -1 and ag is not rt.stream("reduce_scatter")
    with rt.use(ag):
        handle = rt.handle(FakeWork(mod))
    # the work is waited for on the all-gather stream, then its event recorded there
    assert mod.log[0] == ("work.wait", ag.name)
    assert mod.log[1][0] == "record" and mod.log[1][2] == ag.name
    rt.wait_for(handle)  # the current (default) stream waits for it
    assert mod.log[-1] == ("wait_event", "default", handle.event.name)

    buf = torch.zeros(8)
    rt.release("buf", buf, ag)  # consumed on default, allocated on ag: deferred
    assert buf.untyped_storage().size() > 0
    recorded = mod.log[-1]
    assert recorded[0] == "record" and recorded[2] == "default"
    rt.reclaim(ag)
    assert mod.log[-1] == ("wait_event", ag.name, recorded[1])
    assert buf.untyped_storage().size() == 0

    own = torch.zeros(8)
    rt.release("own", own, mod.default)  # allocated where it is consumed: freed at once
    assert own.untyped_storage().size() == 0
    rt.wait_stream(ag)
    assert mod.log[-1] == ("wait_stream", ag.name, "default")
