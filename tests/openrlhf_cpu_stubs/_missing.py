"""What every stand-in raises when it is really used."""


def unavailable(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name} is a CPU test stand-in (tests/openrlhf_cpu_stubs): not available here")

    return call
