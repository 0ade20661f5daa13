// An MLP Q-network's greedy action and TD update, and a verifiable update's Adam step, each called once from
// Python instead of op by op.
//
// These are the aten ops, in the order and with the arguments, that agents/dqn.py's Python path dispatches
// for an MLPQNetwork with the update's shortcuts (td_update, MLPQNetwork._layers and write_gradients,
// clip_grad_norm with list ops) and agents/optim.py's LoopAdam, so the bits are the same (tests/test_dqn.py holds them equal on every
// deterministic hardware profile). On a CartPole update each op is a few hundred elements: the Python
// binding around each call cost more than its kernel. The calls still go through torch's dispatcher, so a
// dispatch mode (an emulated hardware profile) sees every op, as it does from Python.
//
// Parameters come as one flat list [weight0, bias0, weight1, bias1, ...], as MLPQNetwork.flat_parameters.

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// A Python number in an op's arguments, as torch's Python binding passes it: a 0-dim double tensor marked as
// a wrapped number. So `x * 0.99` is mul.Tensor here too, the op the Python line dispatches.
at::Tensor number(double v) {
  at::Tensor t = c10::scalar_to_tensor(v);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// MLPQNetwork._layers: ReLU hidden layers, a linear output. If `inputs` is given, each layer's input is kept.
at::Tensor layers(const std::vector<at::Tensor>& p, at::Tensor x, std::vector<at::Tensor>* inputs) {
  TORCH_CHECK(p.size() >= 2 && p.size() % 2 == 0, "an MLP's parameters are weight and bias pairs");
  if (x.scalar_type() != p[0].scalar_type()) x = x.to(p[0].scalar_type());
  const size_t n = p.size() / 2;
  for (size_t k = 0; k + 1 < n; ++k) {
    if (inputs) inputs->push_back(x);
    x = at::relu(at::linear(x, p[2 * k], p[2 * k + 1]));
  }
  if (inputs) inputs->push_back(x);
  return at::linear(x, p[2 * n - 2], p[2 * n - 1]);
}

// The greedy action for one observation (1, obs_dim): int(q.forward(obs).argmax()) under torch.no_grad(), as
// dqn.greedy_policy's Python forward. Not inference mode: that skips the autograd key, where linear becomes
// t and addmm, so a dispatch mode would see linear itself (and a verifiable step round and log another op).
int64_t act(const std::vector<at::Tensor>& q, const at::Tensor& obs) {
  at::NoGradGuard no_grad;
  return layers(q, obs, nullptr).argmax().item<int64_t>();
}

// td_update's shortcut path up to the optimizer step: sets every parameter's .grad (clipped when
// max_grad_norm is given) and returns (loss, Q of the taken actions (batch,)). The caller takes their mean
// after the optimizer step, where the Python paths take it: a verifiable step rounds the ops in that order.
// obs, next_obs (batch, obs_dim); actions (batch,) int64; rewards, not_done (batch,) in the run's dtype.
std::tuple<double, at::Tensor> td_update(const std::vector<at::Tensor>& q,
                                         const std::vector<at::Tensor>& target, const at::Tensor& obs,
                                         const at::Tensor& next_obs, const at::Tensor& actions,
                                         const at::Tensor& rewards, const at::Tensor& not_done, double gamma,
                                         bool double_dqn, bool huber, std::optional<double> max_grad_norm) {
  at::NoGradGuard no_grad;
  // The TD target: r + gamma * max_a' Q_target(s', a') * (1 - terminated).
  at::Tensor next_q = layers(target, next_obs, nullptr);  // (batch, n_actions)
  at::Tensor next_value;
  if (double_dqn) {  // the online network picks the action, the target network values it
    at::Tensor best = layers(q, next_obs, nullptr).argmax(1, true);
    next_value = next_q.gather(1, best).squeeze(1);
  } else {
    next_value = std::get<0>(next_q.max(1));
  }
  at::Tensor td_target = at::add(rewards, at::mul(at::mul(next_value, number(gamma)), not_done));
  at::Tensor taken = actions.unsqueeze(1);  // (batch, 1)

  // The loss and its derivative by the taken actions' Q, then by every Q.
  std::vector<at::Tensor> inputs;
  at::Tensor q_all = layers(q, obs, &inputs);  // (batch, n_actions)
  at::Tensor q_taken = q_all.gather(1, taken).squeeze(1);  // (batch,)
  std::vector<at::Tensor> pair = at::broadcast_tensors({q_taken, td_target});  // as F.smooth_l1_loss/mse_loss
  at::Tensor loss = huber ? at::smooth_l1_loss(pair[0], pair[1], at::Reduction::Mean, 1.0)
                          : at::mse_loss(pair[0], pair[1], at::Reduction::Mean);
  at::Tensor one = at::ones({}, q_taken.options());
  at::Tensor grad_taken = huber ? at::smooth_l1_loss_backward(one, q_taken, td_target, at::Reduction::Mean, 1.0)
                                : at::mse_loss_backward(one, q_taken, td_target, at::Reduction::Mean);
  at::Tensor g = at::zeros_like(q_all).scatter_add_(1, taken, grad_taken.unsqueeze(1));

  // MLPQNetwork.write_gradients: layer by layer from the last.
  for (size_t k = q.size() / 2; k-- > 0;) {
    const at::Tensor& x = inputs[k];
    at::Tensor weight = q[2 * k], bias = q[2 * k + 1];
    weight.mutable_grad() = g.t().mm(x);  // (out, in)
    bias.mutable_grad() = g.sum(0);       // (out,)
    if (k) g = at::threshold_backward(g.mm(weight), x, 0);
  }

  // clip_grad_norm with list ops.
  if (max_grad_norm) {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : q) grads.push_back(p.grad());
    at::Tensor total = at::linalg_vector_norm(at::stack(at::_foreach_norm(grads)));
    at::Tensor scale = at::mul(at::add(total, number(1e-6)).reciprocal(), number(*max_grad_norm));
    at::_foreach_mul_(grads, at::clamp(scale, std::nullopt, 1.0));
  }
  return {loss.item<double>(), q_taken};
}

// A Python int in an op's arguments (`step_t += 1`): a 0-dim int64 tensor marked as a wrapped number.
at::Tensor integer(int64_t v) {
  at::Tensor t = c10::scalar_to_tensor(v);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// LoopAdam's step (agents/optim.py): torch's _single_tensor_adam for plain Adam (not capturable, no weight
// decay, real tensors), parameter by parameter, op for op, with its Python float arithmetic on the step
// count (the same IEEE operations and libm pow, no contraction: extensions.CFLAGS).
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2, double eps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "adam_step: one gradient, state pair and step count per parameter");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor step_t = steps[i], exp_avg = exp_avgs[i], exp_avg_sq = exp_avg_sqs[i], param = params[i];
    step_t.add_(integer(1));
    exp_avg.lerp_(grads[i], 1 - beta1);
    exp_avg_sq.mul_(number(beta2)).addcmul_(grads[i], grads[i], 1 - beta2);
    const double step = step_t.item<double>();
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    at::Tensor denom = at::div(exp_avg_sq.sqrt(), number(bias_correction2_sqrt)).add_(number(eps));
    param.addcdiv_(exp_avg, denom, -step_size);
  }
}

}  // namespace

#ifndef DETRL_BUILT_FOR_TORCH
#define DETRL_BUILT_FOR_TORCH ""  // built on first use, against the torch that is running
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "An MLP Q-network's greedy action, TD update and Adam step as single native calls (agents/mlp_native.cpp)";
  m.attr("built_for_torch") = DETRL_BUILT_FOR_TORCH;
  m.def("act", &act, "the greedy action of one observation (1, obs_dim)");
  m.def("td_update", &td_update, "a TD update's gradients, clipped; returns (loss, Q of the taken actions)");
  m.def("adam_step", &adam_step, "torch's per-tensor Adam step (LoopAdam's fast path)");
}
