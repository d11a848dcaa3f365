"""A superseded controller rolling a stage back (issue 17: under `potluck pipeline run` a stage takes
`configure` from any node that may be elected its cluster's controller; a controller taken for dead
that comes back, or a replayed `configure`, could hand a stage an older epoch's route: its old
neighbours and layers, desynchronising it from the rest of the cluster). Before, any `configure`
from an allowed controller was taken whatever its epoch; now one older than the stage's epoch is
refused with an error that says so, and the stage keeps its newer route."""

from __future__ import annotations

import dataclasses

import pytest

from potluck.core.errors import RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.messages import Configure
from tests.adversarial.test_pipeline_strangers import scene


@pytest.mark.timeout(60)
def test_a_configure_older_than_the_stages_epoch_is_refused():
    async def main():
        s = await scene("superseded")
        target = s.stage(1)
        await s.trains(3)
        old = target.route
        controller = s.controller.transport
        method = s.names.control
        # the controller that took over configures the stage for a newer epoch ...
        await controller.call(target.transport.peer_id, method,
                              Configure(dataclasses.replace(old, epoch=old.epoch + 1)).to_wire(), timeout=10)
        newer = target.route
        assert newer.epoch == old.epoch + 1
        # ... and the superseded one (the same allowed id here) replays the older route
        with pytest.raises(RemoteError, match="older than") as refused:
            await controller.call(target.transport.peer_id, method, Configure(old).to_wire(), timeout=10)
        assert target.route is newer
        await s.close()
        return str(refused.value)

    error = run_virtual(main())
    assert "superseded controller" in error and len(error) < 400
