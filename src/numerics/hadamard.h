#pragma once
// The orthonormal Walsh-Hadamard rotation of SPEC §5: the Sylvester matrix in
// natural order (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]) times n^(-1/2).
// It preserves dot products, which is why the indexer may rotate q and k
// before quantizing them.

namespace dsv4 {

// In place on n floats; n must be a power of two (else x becomes NaN).
void hadamard_rotate(float* x, int n);

}  // namespace dsv4
