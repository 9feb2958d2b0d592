"""Sampling-free moment propagation through a mean-field Gaussian network.

Every layer maps the elementwise mean and variance of its input, both of shape (B, …), to those
of its output, assuming independent inputs (the full-covariance pass drops that assumption).
Weights are w ~ N(μ, σ²) with σ = softplus(ρ).

- :mod:`.activations`: the exact moments of a Gaussian through a Leaky-ReLU (the reference form,
  with closed-form gradients);
- :mod:`.fused`: the same moments and gradients in fewer passes over memory;
- :mod:`.links`: E[link(a)] for a ~ N(m, v), the mean of the learned variance's output link
  under the Gaussian that moment propagation assigns to a pre-activation;
- :mod:`.covariance`: the covariance of activations of two correlated Gaussians (Wu et al.,
  ICLR 2019), for the pass that also carries the covariances between units;
- :mod:`.mehler`: its curvature term by the Mehler series, on a layer's whole covariance matrix
  (the eager pass's form wherever the correlations are moderate);
- :mod:`.sandwich`: the full-covariance pass's M Σ Mᵀ, with its gradients in three products;
- :mod:`.compiling`: torch.compile as the passes use it (dynamic sizes, a quiet first call);
- :mod:`.inference`: the diagonal pass for inference, eagerly in blocks of rows and compiled
  from a plan of the layers' weight means and variances;
- :mod:`.layers`: the Gaussian linear layer, the activation layer and their chain, each with a
  moment pass, a fused pass, a full-covariance pass and a sampled pass (Monte Carlo inference).
"""
