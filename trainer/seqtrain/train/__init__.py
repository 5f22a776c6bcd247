"""The training runtime: rank bootstrap (dist), loss, optimizer + schedules, loop, callbacks, entrypoint."""
