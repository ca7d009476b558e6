"""The decode runner's stages (``prepare``, ``enqueue``, ``draw``) over a fake runner's
``launch``, which runs a whole step: the engine prepares every decode step, enqueues it and
draws it; a fake does its step at the draw."""


class LaunchedInStages:
    def prepare(self, rows, sampling, fed=None):
        return rows, sampling, fed

    def enqueue(self, inputs):
        return inputs

    def draw(self, forward, masks=None):
        assert masks is None, "a fake runner draws no masks"
        return self.launch(*forward)
