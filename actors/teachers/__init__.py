"""Teachers on the actor side: one home for the pool, its config and the bindings it runs.

```
config.py          TeachersConfig and the channel rules (one distill teacher, no teacher for an unweighted
                   channel); no torch, read by the topology check, mesh.ctl and the controller
pool.py            the TeacherPool actor: builds bindings by id, answers trace and top_k
bindings/          one module per teacher kind implementing ``Binding`` (bindings/__init__.py), and
  config.py        BindingConfig with the registered kinds' static checks (no torch)
```

The controller's side (which binding serves which channel, now) is ``mesh/controller/teacher_board.py``.
This file imports nothing, so reading a config never loads the pool's Monarch and torch.
"""
