"""Every test loop with its inputs: name -> () -> (model, args, noise shape or None)."""
import torch

from . import cleandiffuser, cpql, decision_diffuser, diffusers_style, diffusion_policy, diffusion_ql, dipo, \
    dpm_solver, dppo, flow_policy, idql, janner_diffuser, k_diffusion, lucidrains, readme, scheduler_step, score_sde, \
    tabddpm, tiny_diffusion, v1_variants


def _dql():
    torch.manual_seed(0)
    m = diffusion_ql.Diffusion(state_dim=17, action_dim=6, n_timesteps=5)
    return m, (torch.randn(50, 17),), (6, 50, 6)


def _cd(net, solver):
    def make():
        torch.manual_seed(0)
        model = cleandiffuser.DQLMlp(11, 3) if net == "dql" else cleandiffuser.MlpNNDiffusion(3)
        m = cleandiffuser.DiscreteDiffusionSDE(model, 3, diffusion_steps=20, sampling_steps=5, solver=solver)
        return m, (torch.randn(16, 11),), (6, 16, 3)
    return make


def _diffusers(kind, clip):
    def make():
        torch.manual_seed(0)
        m = diffusers_style.SchedulerLoop(kind=kind, clip_sample=clip)
        return m, (torch.randn(8, 3),), (11, 8, 4)
    return make


def _tiny():
    torch.manual_seed(0)
    return tiny_diffusion.TinyDiffusion(num_timesteps=10), (32,), (11, 32, 2)


def _tabddpm(**kw):
    torch.manual_seed(0)
    m = tabddpm.GaussianSampler(num_timesteps=8, as_project=False, **kw)
    return m, (torch.randint(0, 3, (64,)),), (9, 64, 6)


def _v1(**kw):
    def make():
        torch.manual_seed(0)
        m = v1_variants.PosteriorSampler(**kw)
        b = 8
        x = torch.randn(b, m.dim)
        if kw.get("timesteps", "tensor") == "tensor":
            t = torch.randint(m.num_steps - 1, m.T, (b,))
        else:
            t = m.T - 1
        args = (x, t, torch.randn(b, m.obs_dim) if m.obs_dim else None)
        return m, args, (m.num_steps, b, m.dim) if m.noise else None
    return make


def _readme(**kw):
    def make():
        torch.manual_seed(0)
        m = readme.TimeColumnLoop(**kw)
        return m, (torch.randn(8, 4), torch.randint(m.num_steps, m.total_timesteps, (8,))), \
            (m.num_steps, 8, 4) if m.noise else None
    return make


def _lucidrains(batch, **kw):
    """denoising-diffusion-pytorch's p_sample_loop; a batch of as many rows as the schedule has
    timesteps makes every table look like one value per sample by its shape alone."""
    def make():
        torch.manual_seed(0)
        m = lucidrains.GaussianDiffusion(**kw)
        return m, (torch.randn(batch, 5),), (m.num_timesteps + 1, batch, m.dim)
    return make


def _diffusion_policy(**kw):
    def make():
        torch.manual_seed(0)
        m = diffusion_policy.LowdimPolicy(**kw)
        return m, (torch.randn(8, 2, 5), torch.randn(8, m.horizon, m.action_dim)), None
    return make


def _int_scheduler():
    torch.manual_seed(0)
    return scheduler_step.IntTimestepLoop(), (torch.randn(8, 3),), (10, 8, 3)


def _residual(**kw):
    def make():
        torch.manual_seed(0)
        m = v1_variants.ResidualSampler(noise=True, **kw)
        return m, (torch.randn(8, m.dim), m.T - 1, None), (m.num_steps, 8, m.dim)
    return make


def _dppo(**kw):
    def make():
        torch.manual_seed(0)
        m = dppo.DPPODiffusion(**kw)
        return m, (torch.randn(16, 11),), (m.denoising_steps + 1, 16, m.horizon, m.action_dim)
    return make


def _idql(**kw):
    def make():
        torch.manual_seed(0)
        return idql.IDQLActor(**kw).eval(), (torch.randn(16, 11),), (6, 16, 3)
    return make


def _flow(**kw):
    def make():
        torch.manual_seed(0)
        return flow_policy.FlowPolicy(**kw), (torch.randn(16, 11), torch.randn(16, 3)), None
    return make


def _flow_spelling(spelling, **kw):
    def make():
        torch.manual_seed(0)
        return flow_policy.FlowSpellings(spelling, **kw), (torch.randn(16, 11), torch.randn(16, 3)), None
    return make


def _dpm(kind, **kw):
    """A DPM-Solver++ 2M loop of tests/loops/dpm_solver.py: an ODE sampler draws no noise after x_T,
    the SDE one every step (given as a tensor)."""
    def make():
        torch.manual_seed(0)
        m = getattr(dpm_solver, kind)(**kw)
        batch, obs_dim = (8, 3) if kind == "DiffusersStyle2M" else (16, 11)
        dim = 4 if kind == "DiffusersStyle2M" else 3
        noise = (m.sample_steps, batch, dim) if kw.get("solver", "").startswith("sde") else None
        return m, (torch.randn(batch, obs_dim), torch.randn(batch, dim)), noise
    return make


def _cd_sample(**kw):
    """CleanDiffuser's DiscreteDiffusionSDE.sample as the library spells it (cleandiffuser.SampleStepSchedule):
    ``prior`` the known portion (zeros where ``fix_mask`` is zero)."""
    def make():
        torch.manual_seed(0)
        m = cleandiffuser.SampleStepSchedule(**kw)
        return m, (torch.randn(16, 11), torch.zeros(16, 3)), (m.sampling_steps + 1, 16, 3)
    return make


def _diffusers_step(kind, **kw):
    def make():
        torch.manual_seed(0)
        m = diffusers_style.SchedulerLoop(kind=kind, **kw)
        return m, (torch.randn(8, 3),), (11, 8, 4)
    return make


def _dql_variant(**kw):
    def make():
        torch.manual_seed(0)
        if kw.get("t_arg"):
            m = diffusion_ql.DiffusionVariants(state_dim=17, action_dim=6, n_timesteps=20, **kw)
            # Rows starting at t = 4 reach t = 0 on the last step (no noise there), the others do not.
            t = torch.randint(m.steps - 1, m.n_timesteps, (50,))
            t[:3] = m.steps - 1
            return m, (torch.randn(50, 17), t), (m.steps + 1, 50, 6)
        m = diffusion_ql.DiffusionVariants(state_dim=17, action_dim=6, n_timesteps=5, **kw)
        return m, (torch.randn(50, 17),), (6, 50, 6)
    return make


def _dppo_ddim(**kw):
    def make():
        torch.manual_seed(0)
        m = dppo.DPPODDIM(**kw)
        return m, (torch.randn(16, 11),), (m.ddim_steps + 1, 16, m.horizon, m.action_dim)
    return make


def _tiny_project(**kw):
    def make():
        torch.manual_seed(0)
        return tiny_diffusion.ProjectSampler(**kw), (32,), (11, 32, 2)
    return make


def _dql_sample_action():
    torch.manual_seed(0)
    m = diffusion_ql.SampleAction(state_dim=17, action_dim=6, n_timesteps=5)
    return m, (torch.randn(1, 17),), (6, 50, 6)


def _tabddpm_project():
    """TabDDPM's GaussianMultinomialDiffusion.sample (numerical features): float64 between its networks."""
    torch.manual_seed(0)
    m = tabddpm.GaussianMultinomialDiffusion(num_timesteps=8)
    return m, (torch.randint(0, 3, (64,)),), (9, 64, 6)


def _tabddpm_ddim(**kw):
    def make():
        torch.manual_seed(0)
        m = tabddpm.GaussianDDIMSampler(num_timesteps=8, **kw)
        y = torch.randn(64) if kw.get("num_classes") == 0 else torch.randint(0, 3, (64,))
        return m, (y,), (9, 64, 6)
    return make


def _project(module, cls, args, noise_shape, **kw):
    """A loop of ``module.cls(**kw)`` called as ``model(*args, noise)``; ``args`` and ``noise_shape``
    functions of the model."""
    def make():
        torch.manual_seed(0)
        m = getattr(module, cls)(**kw)
        return m, args(m), noise_shape(m)
    return make


def _dipo(**kw):
    return _project(dipo, "DIPODiffusion", lambda m: (torch.randn(16, m.state_dim),),
                    lambda m: (m.n_timesteps + 1, 16, m.action_dim), **kw)


def _janner(**kw):
    return _project(janner_diffuser, "GaussianDiffusion", lambda m: (torch.randn(16, m.observation_dim),),
                    lambda m: (m.n_timesteps + 1, 16, m.horizon, m.transition_dim), **kw)


def _decision_diffuser(**kw):
    return _project(decision_diffuser, "ActionGaussianDiffusion",
                    lambda m: (torch.randn(16, m.observation_dim), 0.9 * torch.ones(16, 1)),
                    lambda m: (m.n_timesteps + 1, 16, m.action_dim), **kw)


def _score_sde(**kw):
    return _project(score_sde, "PCSampler", lambda m: (), lambda m: (m.sde.N + 1, 16, m.dim), **kw)


def _cpql(**kw):
    return _project(cpql, "CPQLActor", lambda m: (torch.randn(16, 11),), lambda m: (4, 16, 3), **kw)


def _dppo_eval(**kw):
    def make():
        torch.manual_seed(0)
        m = dppo.DPPOEval(**kw)
        steps = m.ddim_steps if m.use_ddim else m.denoising_steps
        return m, ({"state": torch.randn(16, 2, 11)},), (steps + 1, 16, m.horizon_steps, m.action_dim)
    return make


def _karras(sampler="euler"):
    """A Karras-preconditioned sampler of tests/loops/k_diffusion.py: ``noise[0]`` the initial draw,
    ``noise[1 + i]`` step ``i``'s (the ancestral sampler's)."""
    def make():
        torch.manual_seed(0)
        m = k_diffusion.EulerDiscrete() if sampler == "euler_discrete" else k_diffusion.KarrasSampler(sampler)
        return m, (torch.randn(16, 11),), (len(m.sigmas), 16, 3)
    return make


def _cd_sde_sample(**kw):
    """CleanDiffuser's DiscreteDiffusionSDE.sample as its current release writes it
    (cleandiffuser.DiscreteSDESample): ``prior`` zeros, as its pipelines pass it."""
    def make():
        torch.manual_seed(0)
        m = cleandiffuser.DiscreteSDESample(**kw)
        return m, (torch.randn(16, m.obs_dim), torch.zeros(16, 3)), (m.sample_steps + 1, 16, 3)
    return make


CASES = {
    "diffusion_ql": _dql,
    "cleandiffuser_dql_ddpm": _cd("dql", "ddpm"),
    "cleandiffuser_dql_ddim": _cd("dql", "ddim"),
    "cleandiffuser_relu_ddpm": _cd("relu", "ddpm"),
    "cleandiffuser_relu_ddim": _cd("relu", "ddim"),
    "diffusers_ddpm_clip": _diffusers("ddpm", True),
    "diffusers_ddpm_noclip": _diffusers("ddpm", False),
    "diffusers_ddim_clip": _diffusers("ddim", True),
    "diffusers_ddim_noclip": _diffusers("ddim", False),
    "tiny_diffusion": _tiny,
    "tabddpm": _tabddpm,
    "tabddpm_long_after_full": lambda: _tabddpm(long_after_full=True),
    "tabddpm_gaussian_multinomial_float64_variance": _tabddpm_project,
    "v1_posterior": _v1(),
    "v1_expand": _v1(lookup="expand"),
    "v1_int_t": _v1(timesteps="int"),
    "v1_full_t": _v1(timesteps="full"),
    "v1_obs": _v1(obs_dim=5),
    "v1_noise_clamps": _v1(noise=True, clip=(-1.0, 1.0), post_clip=(-3.0, 3.0)),
    "v1_full_noise_clamps": _v1(timesteps="full", noise=True, clip=(-1.0, 1.0), post_clip=(-3.0, 3.0)),
    "v1_gather_expand": _v1(lookup="gather_expand"),
    "v1_gather_expand_obs": _v1(lookup="gather_expand", obs_dim=5),
    "readme_noise": _readme(noise=True),
    "readme_clamp": _readme(clamp=2.0),
    "readme_noise_clamp": _readme(noise=True, clamp=2.0),
    "int_t_scheduler_step": _int_scheduler,
    "diffusion_policy_lowdim_ddim": _diffusion_policy(),
    "lucidrains_pred_noise": _lucidrains(5),
    "lucidrains_pred_noise_batch_of_timesteps": _lucidrains(8, timesteps=8),
    "lucidrains_pred_v": _lucidrains(5, objective="pred_v"),
    "lucidrains_pred_x0_unclipped": _lucidrains(5, objective="pred_x0", clip_denoised=False),
    "idql": _idql(),
    "idql_ln_resnet": _idql(network="ln_resnet"),
    "idql_repeat_time": _idql(time_spelling="repeat"),
    "dppo": _dppo(),
    "dppo_residual_mlp": _dppo(residual_style=True),
    "dppo_residual_mlp_flat": _residual(),
    "dppo_residual_mlp_layer_norm_flat": _residual(use_layernorm=True),
    "flow_policy_euler": _flow(),
    "flow_policy_euler_fourier_time": _flow(time_embedding=True),
    "flow_policy_euler_ones_time": _flow_spelling("ones"),
    "flow_policy_euler_float_time": _flow_spelling("float_arg"),
    "flow_policy_euler_float_time_fourier": _flow_spelling("float_arg", fourier_time=True),
    "flow_policy_euler_linspace_expand": _flow_spelling("linspace"),
    "flow_policy_euler_linspace_expand_fourier": _flow_spelling("linspace", fourier_time=True),
    "flow_policy_euler_linspace_repeat_fourier": _flow_spelling("repeat", fourier_time=True),
    "flow_policy_euler_linspace_loop_fourier": _flow_spelling("tensor_loop", fourier_time=True),
    "flow_policy_euler_inplace": _flow_spelling("inplace"),
    "flow_policy_euler_sinusoidal_time": _flow_spelling("sinusoidal"),
    "cleandiffuser_dpmsolver++_2M_eps": _dpm("CleanDiffuser2M"),
    "cleandiffuser_dpmsolver++_2M_eps_clip": _dpm("CleanDiffuser2M", x_max=1.0),
    "cleandiffuser_dpmsolver++_2M_eps_bounds": _dpm("CleanDiffuser2M", eps_bounds=True),
    "cleandiffuser_sde_dpmsolver++_2M_eps_bounds": _dpm("CleanDiffuser2M", eps_bounds=True,
                                                        solver="sde_dpmsolver++_2M"),
    "cleandiffuser_dpmsolver++_2M_x0": _dpm("CleanDiffuser2M", predict_noise=False),
    "cleandiffuser_dpmsolver++_2M_x0_clip": _dpm("CleanDiffuser2M", predict_noise=False, x_max=0.5),
    "cleandiffuser_sde_dpmsolver++_2M_eps_clip": _dpm("CleanDiffuser2M", x_max=1.0, solver="sde_dpmsolver++_2M"),
    "diffusers_dpmsolver++_2M_eps": _dpm("DiffusersStyle2M"),
    "diffusers_dpmsolver++_2M_eps_clip": _dpm("DiffusersStyle2M", clip=1.0),
    "diffusers_dpmsolver++_2M_sample_clip": _dpm("DiffusersStyle2M", prediction_type="sample", clip=1.0),
    "diffusers_dpmsolver++_2M_v_sigma_min": _dpm("DiffusersStyle2M", prediction_type="v_prediction",
                                                 final_sigmas_type="sigma_min"),
    "dpm_solver_2M_named_previous": _dpm("NamedPrevious2M", clip=None),
    "dpm_solver_2M_named_previous_clip": _dpm("NamedPrevious2M"),
    "cleandiffuser_sample_ddpm": _cd_sample(),
    "cleandiffuser_sample_ddim": _cd_sample(solver="ddim"),
    "cleandiffuser_sample_ddpm_at_least_ndim": _cd_sample(per_sample=True),
    "diffusers_ddpm_v_prediction_clip": _diffusers_step("ddpm", clip_sample=True, prediction_type="v_prediction"),
    "diffusers_ddpm_sample_prediction_clip": _diffusers_step("ddpm", clip_sample=True, prediction_type="sample"),
    "diffusers_ddim_eta1_clip": _diffusers_step("ddim", clip_sample=True, eta=1.0),
    "diffusers_ddim_eta1_noclip": _diffusers_step("ddim", clip_sample=False, eta=1.0),
    "diffusers_ddim_unclipped_eps_clip": _diffusers_step("ddim", clip_sample=True, use_clipped_model_output=False),
    "diffusers_ddim_v_prediction_clip": _diffusers_step("ddim", clip_sample=True, prediction_type="v_prediction"),
    "diffusion_ql_predict_x0": _dql_variant(predict_epsilon=False),
    "diffusion_ql_where_mask": _dql_variant(mask="where"),
    "diffusion_ql_inloop_sqrt": _dql_variant(inloop_sqrt=True),
    "diffusion_ql_t_arg": _dql_variant(t_arg=True),
    "diffusion_ql_t_arg_where_mask": _dql_variant(t_arg=True, mask="where"),
    "cleandiffuser_sample_ddpm_float_tables": _cd_sample(tables="floats"),
    "cleandiffuser_sample_ddpm_x0_clip_tensor_bounds": _cd_sample(clip="x0"),
    "diffusion_ql_select_mask": _dql_variant(mask="select"),
    "diffusion_ql_t_arg_select_mask": _dql_variant(t_arg=True, mask="select"),
    # Linears built with bias=False: the op takes a bias per layer, given zeros there (a graph constant).
    "diffusion_ql_bias_free": _dql_variant(bias_free=("mid", "final")),
    "diffusion_ql_bias_free_first": _dql_variant(bias_free=("first",)),
    "diffusion_ql_bias_free_final": _dql_variant(bias_free=("final",)),
    "diffusion_ql_bias_free_time_mlp": _dql_variant(bias_free=("time",)),
    "diffusion_ql_t_arg_bias_free": _dql_variant(t_arg=True, bias_free=("first", "final", "time")),
    # The per-sample timesteps each step makes again, through the time MLP or the sinusoidal features alone.
    "diffusion_ql_repeat_time": _dql_variant(time_spelling="repeat"),
    "diffusion_ql_expand_time": _dql_variant(time_spelling="expand"),
    "diffusion_ql_sinusoidal_time": _dql_variant(time_embedding="sinusoidal"),
    "diffusion_ql_repeat_time_sinusoidal": _dql_variant(time_spelling="repeat", time_embedding="sinusoidal"),
    "diffusion_ql_expand_time_sinusoidal": _dql_variant(time_spelling="expand", time_embedding="sinusoidal"),
    "diffusion_ql_repeat_time_column_mlp": _dql_variant(time_spelling="repeat", time_embedding="column_mlp"),
    "diffusion_ql_expand_time_column_mlp": _dql_variant(time_spelling="expand", time_embedding="column_mlp"),
    "diffusion_ql_index_expand_time": _dql_variant(time_spelling="index_expand"),
    "diffusion_ql_index_expand_time_sinusoidal": _dql_variant(time_spelling="index_expand",
                                                              time_embedding="sinusoidal"),
    "dppo_ddim": _dppo_ddim(),
    "tiny_diffusion_numpy_t_blocks": _tiny_project(),
    "dppo_ddim_eta1": _dppo_ddim(eta=1.0),
    "diffusion_ql_sample_action_repeat_interleave": _dql_sample_action,
    "tabddpm_sample_ddim": _tabddpm_ddim(),
    "tabddpm_gaussian_ddim_sample_ones_long_t": _tabddpm_ddim(spelling="ddim_sample"),
    "dppo_eval_forward_dict_cond_plain_tables": _dppo_eval(),
    "dppo_eval_ddim_tensor_timesteps": _dppo_eval(use_ddim=True),
    # DPPO's DDIM eps_clip_value: eps read back from the clamped x0 and clamped (the op's rows Q and
    # R and its eps_clip); without denoised_clip_value, the network's eps clamped.
    "dppo_eval_ddim_eps_clip": _dppo_eval(use_ddim=True, eps_clip_value=0.5),
    "dppo_eval_ddim_eps_clip_unclamped_x0": _dppo_eval(use_ddim=True, eps_clip_value=0.5, denoised_clip_value=None),
    # CleanDiffuser's default fix_mask (0.): ``xt * (1. - 0.) + prior * 0.`` after the initial draw and
    # every step. ``c = prior * 0.`` is +-0 where the prior is finite and NaN where it is not: the op
    # runs from ``x_T + c`` and ``c`` is added to its result, computed once a call.
    "cleandiffuser_sde_sample_idql_ddim_x0": _cd_sde_sample(net="idql", solver="ddim", predict_noise=False),
    "cleandiffuser_sde_sample_dql_ddpm_x0": _cd_sde_sample(predict_noise=False),
    # CleanDiffuser's predict-noise clip bounds eps by ((xt - alpha * x_max) / sigma, (xt - alpha *
    # x_min) / sigma): with alpha / sigma > 0 at every step (proved on the tables' values) it is
    # the clamp of x0 = (xt - sigma * eps) / alpha to (x_min, x_max), written on eps.
    "cleandiffuser_sde_sample_dql_ddpm": _cd_sde_sample(),
    "cleandiffuser_sde_sample_idql_ddim": _cd_sde_sample(net="idql", solver="ddim"),
    "cleandiffuser_sample_ddpm_eps_clip_tensor_bounds": _cd_sample(clip="eps"),
    # MlpNNDiffusion adds the condition in place to the timestep features (``t += condition``) before
    # the cat: the sum's addends are read through the same columns of the first Linear, the features
    # as time rows and the condition as the condition network.
    "cleandiffuser_sde_sample_mlp_ddpm_x0": _cd_sde_sample(net="mlp", obs_dim=12, predict_noise=False),
    # The network reads the sample scaled by a number per step (c_in * x): the op's state is that
    # scaled sample, its tables rescaled step by step.
    "k_diffusion_denoiser_euler": _karras("euler"),
    "k_diffusion_denoiser_euler_ancestral": _karras("euler_ancestral"),
    "edm_precond_euler": _karras("edm_euler"),
    "beso_gc_denoiser_ddim": _karras("beso_ddim"),
    "diffusers_euler_discrete_scale_model_input": _karras("euler_discrete"),
    # The chunk read and written channels first (ConditionalUnet1D's convention on an MLP): the op
    # runs the network's order of the chunk's elements.
    "diffusion_policy_lowdim_ddim_channels_first": _diffusion_policy(channels_first=True),
    # DIPO: its noise scaled by noise_ratio.
    "dipo": _dipo(),
    "dipo_small_noise": _dipo(noise_ratio=0.1),
    # Janner's diffuser and Decision Diffuser without their conditioning (inpainting, guidance).
    "janner_diffuser_eps_clip": _janner(predict_epsilon=True, clip_denoised=True, conditioning=False),
    "decision_diffuser_unguided": _decision_diffuser(returns_condition=False),
    # score_sde's predictor-corrector sampler on a VP SDE: continuous time t * ones(B) read by the score
    # function's scaling; the discrete reverse-diffusion predictor (beta_max 3: 6 steps of beta_max 20
    # make eager's alphas negative) and its probability flow.
    "score_sde_euler_maruyama": _score_sde(),
    "score_sde_euler_maruyama_last_x": _score_sde(denoise=False),
    "score_sde_reverse_diffusion": _score_sde(predictor="reverse_diffusion", continuous=False, beta_max=3.0),
    "score_sde_probability_flow": _score_sde(predictor="reverse_diffusion", continuous=False, beta_max=3.0,
                                             probability_flow=True),
    # CPQL's consistency-model multistep sampler: noise added before each network call, c_in * x.
    "cpql_multistep": _cpql(),
    "cpql_multistep_unclipped": _cpql(clip_denoised=False),
}


# Project loops the op cannot run: name -> (factory as above, what the DEBUG line says). They are
# compiled unchanged (eager's numbers) and the rewrite names the fact it did not prove.
LEFT_ALONE = {
    # The fix_mask blend scales the sample by a (dim,) vector: the op's coefficients are one per sample.
    "cleandiffuser_sample_ddim_fix_mask": (
        _cd_sample(solver="ddim", fix_mask=True), "is not one number per sample (a (B, 1) column or a scalar)"),
    # tiny-diffusion's default input embedding: sin and cos of each coordinate of the sample, a
    # function of the sample that is not the first Linear's (one line per step: each application
    # of the network reads the previous sample through two pieces).
    "tiny_diffusion_numpy_t_sinusoidal_input": (
        _tiny_project(input_emb="sinusoidal"), "reads the previous step's sample in more than one piece"),
    # Janner's diffuser inpaints the state into the trajectory after every step (x[:, 0, action_dim:] =
    # state, a select_scatter): the op writes whole rows of the sample, not fixed elements of it.
    "janner_diffuser_inpainting": (
        _janner(predict_epsilon=True, clip_denoised=True),
        "(aten.select_scatter.default) is not add, sub, mul, div, neg, clamp or a view"),
    # Decision Diffuser's classifier-free guidance: two network calls a step, combined; the op calls
    # its network once a step.
    "decision_diffuser_guided": (
        _decision_diffuser(), "(aten.addmm.default) is not add, sub, mul, div, neg, clamp or a view"),
}
